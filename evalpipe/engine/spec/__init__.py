"""Block speculation: what its flags mean, torch-free (settings.py: the acceptance rule, the drafter spec), the
acceptance rules and statistics (accept.py), the drafters (drafters.py) and the step that drafts, verifies in one
target forward and rolls back (decoder.py, SpeculativeDecoder). The engine loop calls the decoder; engine/build.py
makes it from the server settings."""
