from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from kvops.api import errors, timeline, usage, views

router = DefaultRouter()
router.register("jobs", views.JobViewSet, basename="job")
router.register("engines", views.EngineViewSet, basename="engine")
router.register("actions", views.OperatorActionViewSet, basename="action")

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("prefix-lookup/", views.PrefixLookupView.as_view(), name="prefix-lookup"),
    path("usage/", usage.UsageView.as_view(), name="usage"),
    path("engines/<str:name>/requests/<str:request_id>/<str:action>/",
         views.RequestActionView.as_view(), name="request-action"),
    path("engines/<str:name>/prefix-cache/<str:action>/",
         views.PrefixCacheActionView.as_view(), name="prefix-cache-action"),
    path("engines/<str:name>/limits/", views.EngineLimitsView.as_view(), name="engine-limits"),
    path("engines/<str:name>/retention/", views.EngineRetentionView.as_view(),
         name="engine-retention"),
    path("engines/<str:name>/tenants/", views.EngineTenantView.as_view(), name="engine-tenants"),
    path("engines/<str:name>/timeline/", timeline.EngineTimelineView.as_view(),
         name="engine-timeline"),
    path("engines/<str:name>/timeline/state/", timeline.EngineTimelineStateView.as_view(),
         name="engine-timeline-state"),
    path("engines/<str:name>/what-if/", views.WhatIfView.as_view(), name="engine-what-if"),
    path("engines/<str:name>/what-if/<int:run_id>/", views.WhatIfDetailView.as_view(),
         name="engine-what-if-run"),
    *(path(f"engines/<str:name>/{action}/", views.EngineActionView.as_view(),
           {"action": action}, name=f"engine-{action}")
      for action in views.EngineActionView.ACTIONS),
    *router.urls,
    re_path(r"^(?P<path>.*)$", errors.not_found),  # after every /api route
]
