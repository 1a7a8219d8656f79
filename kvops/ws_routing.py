"""Websocket URLs (consumers in kvops/consumers.py)."""
websocket_urlpatterns: list = []
