"""The proxy's routers: health, models, chat completions, completions, sessions."""
