from django.apps import AppConfig


class KvopsConfig(AppConfig):
    name = "kvops"
    verbose_name = "kvops"
    default_auto_field = "django.db.models.BigAutoField"
