"""The full-duplex voice session over WebSocket /v1/duplex (protocol.py has the map)."""
