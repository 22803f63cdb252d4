"""The OpenAI-compatible HTTP layer: routes, request bodies, their translation onto engine requests,
response shapes, chat templates, middleware. A thin translation: it never schedules and never talks to a child."""
