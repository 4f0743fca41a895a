"""OpenAI-compatible server and the xpulora command line."""
