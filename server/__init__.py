"""The OpenAI-compatible server, its settings and the mixbit CLI."""
