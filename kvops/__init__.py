"""kvops service: Django project and app, Celery app, engine worker bootstrap."""
from kvops.celery import app as celery_app

__all__ = ["celery_app"]
