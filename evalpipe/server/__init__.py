"""The OpenAI-compatible HTTP layer over the native engine (FastAPI + uvicorn). `evalpipe serve` starts it;
state.py builds the engine with evalpipe.engine.build and runs it on its loader thread. app.py: routes; protocol.py:
request bodies; generation.py: request -> engine sequences -> responses and streams; structured.py: what tools,
tool_choice and response_format ask the engine for; tool_calls.py: tool calls out of the generated text."""
