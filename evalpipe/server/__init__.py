"""The OpenAI-compatible HTTP layer over the native engine (FastAPI + uvicorn)."""
