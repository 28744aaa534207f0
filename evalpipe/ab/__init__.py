"""`evalpipe ab`: boot arm A and arm B fresh through the launchers, run the lanes on each, compare, one report."""
