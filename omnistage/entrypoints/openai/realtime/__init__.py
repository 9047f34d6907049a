"""OpenAI's Realtime protocol over WebSocket /v1/realtime (connection.py has the map)."""
