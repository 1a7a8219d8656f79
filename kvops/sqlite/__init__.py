"""Django's SQLite backend with one queue for writers across processes (base.py)."""
