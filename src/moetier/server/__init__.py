"""OpenAI-compatible HTTP server: app, protocol models, auth, streaming, engine process.

Never touches tensors; talks to the engine only through the engine process's queues.
"""
