from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path

from kvops import openai_api, views
from kvops.monitoring import health, metrics_view
from kvops.openai import responses

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
    path("v1/completions", openai_api.completions),
    path("v1/chat/completions", openai_api.chat_completions),
    path("v1/models", openai_api.models),
    path("v1/models/<path:model>", openai_api.model),
    path("v1/responses", responses.responses),
    path("v1/responses/<str:response_id>", responses.response),
    re_path(r"^v1/(?P<path>.*)$", openai_api.not_found),  # after every /v1 route
    path("tokenize", openai_api.tokenize),  # vLLM serves these two at the root
    path("detokenize", openai_api.detokenize),
    path("metrics", metrics_view.metrics, name="metrics"),
    path("healthz", health.healthz, name="healthz"),
    path("health", health.health),  # as vLLM serves these three
    path("ping", health.ping),
    path("version", health.version),
]
