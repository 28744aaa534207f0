"""`evalpipe qualify`: serving qualification gates against any OpenAI-compatible endpoint.

One module per gate family (auth, retrieval, consistency = boundaries + mixed, structured, soak, reference,
sampling, vision, kv_pressure), what the server exposes about its sizes in server_sizes.py, the
shared endpoint and records in core.py, the orchestration and folder in run.py, the views in report.py.
"""

# The order gates run in: the reference right after auth, so that it sees the server as fresh as it gets.
# kv-pressure last: it fills the server's KV pool past its size, evicting whatever the other gates left cached.
GATES = (
    "auth",
    "reference",
    "retrieval",
    "boundaries",
    "mixed",
    "structured",
    "soak",
    "sampling",
    "vision",
    "kv-pressure",
)

EXIT_PASS = 0
EXIT_BAD_INPUT = 2  # usage errors, an unreadable --reference, an unknown model, a refused key, a used --out
EXIT_CANNOT_CONNECT = 3  # the endpoint is unreachable or not OpenAI-compatible
EXIT_GATE_FAILED = 4  # the gates ran and at least one failed (qualify.json says which and why)
EXIT_INTERRUPTED = 130
