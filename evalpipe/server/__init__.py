"""The OpenAI-compatible HTTP layer over the native engine (FastAPI + uvicorn). `evalpipe serve` starts it;
state.py starts the engine process (evalpipe.engine.process, which builds the engine with evalpipe.engine.build);
engine_client.py: this process's side of it (ZeroMQ). app.py: routes; protocol.py:
request bodies; validation.py: request -> Job; jobs.py: a Job's life in the engine; responses.py: the full
response and the SSE stream; generation.py: the route flow over those three; structured.py: what tools,
tool_choice and response_format ask the engine for; tool_calls.py: tool calls out of the generated text."""
