"""Side-by-side comparison of two run folders (or two bench folders): paired statistics and a report."""
