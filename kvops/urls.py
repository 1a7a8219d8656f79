from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from kvops import views
from kvops.monitoring import health, metrics_view
from kvops.openai import completions, errors, responses, served_models, tokenize

urlpatterns = [
    path("", views.overview, name="overview"),
    path("engines/<str:name>/", views.engine_page, name="engine"),
    path("jobs/", views.jobs_page, name="jobs"),
    path("jobs/<int:job_id>/", views.job_page, name="job"),
    path("actions/", views.actions_page, name="actions"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/", include("kvops.api.urls")),
    path("v1/completions", completions.completions),
    path("v1/chat/completions", completions.chat_completions),
    path("v1/models", served_models.models),
    path("v1/models/<path:model>", served_models.model),
    path("v1/responses", responses.responses),
    path("v1/responses/<str:response_id>", responses.response),
    re_path(r"^v1/(?P<path>.*)$", errors.not_found),  # after every /v1 route
    path("tokenize", tokenize.tokenize),  # vLLM serves these two at the root
    path("detokenize", tokenize.detokenize),
    path("metrics", metrics_view.metrics, name="metrics"),
    path("healthz", health.healthz, name="healthz"),
    path("health", health.health),  # as vLLM serves these three
    path("ping", health.ping),
    path("version", health.version),
]
