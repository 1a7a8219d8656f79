from django.contrib import admin

from kvops.models import Engine, Job, OperatorAction


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "status", "engine", "source", "num_prompt_tokens",
                    "num_cached_tokens", "num_output_tokens", "num_preemptions", "queued_at")
    list_filter = ("status", "engine", "source")
    search_fields = ("prompt", "output_text", "request_id")


@admin.register(Engine)
class EngineAdmin(admin.ModelAdmin):
    list_display = ("name", "worker", "host", "status", "last_heartbeat")


@admin.register(OperatorAction)
class OperatorActionAdmin(admin.ModelAdmin):
    """The audit log: read here, written only by kvops/operators/audit_chain.py (no one, superusers
    included, adds, changes or deletes a row; `manage.py verify_audit` checks them)."""
    list_display = ("id", "created_at", "user", "engine", "action", "target", "ok", "status_code")
    list_filter = ("engine", "action", "ok")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
