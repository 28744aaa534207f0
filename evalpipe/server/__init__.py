"""The OpenAI-compatible HTTP layer over the native engine (FastAPI + uvicorn). `evalpipe serve` starts it;
state.py builds the engine with evalpipe.engine.build and runs it on its loader thread."""
