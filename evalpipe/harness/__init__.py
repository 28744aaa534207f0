"""The client side: everything that talks to a server and owns a run folder (run, repeat, bench, audit)."""
