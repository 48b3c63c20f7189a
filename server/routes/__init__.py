"""The HTTP routes, one router per API: OpenAI (models, chat and text completions, scoring),
Responses, Anthropic Messages, and admin (health, readiness, metrics, fidelity)."""

from __future__ import annotations

from . import admin, anthropic, openai, responses

ROUTERS = (admin.router, openai.router, responses.router, anthropic.router)
