"""Django settings, from environment variables with defaults that work on one machine.

DATABASE_URL  database (default: SQLite file under KVOPS_DATA_DIR)
REDIS_URL     Celery broker, channel layer, live state (default redis://127.0.0.1:6379/0)
KVOPS_DATA_DIR  where the database, models and artefacts live (default <repo>/data)
"""
import os
import re
from pathlib import Path

import dj_database_url

from kvops.infra.broker import broker_url

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("KVOPS_DATA_DIR", BASE_DIR / "data"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


DEBUG = env_bool("KVOPS_DEBUG", False)
DEV_SECRET_KEY = "kvops-insecure-dev-key-set-DJANGO_SECRET_KEY"


def _secret_key() -> str:
    """DJANGO_SECRET_KEY, else the data dir's key file (`make run` writes one on first
    run); the public development key only with KVOPS_DEBUG on."""
    key = os.environ.get("DJANGO_SECRET_KEY", "")
    if not key:
        path = DATA_DIR / "secret_key"
        key = path.read_text().strip() if path.is_file() else ""
    if key:
        return key
    if DEBUG:
        return DEV_SECRET_KEY
    from django.core.exceptions import ImproperlyConfigured
    raise ImproperlyConfigured(
        "no secret key: set DJANGO_SECRET_KEY to a long random string (for example the "
        "output of `python -c 'import secrets; print(secrets.token_urlsafe(50))'`), or put "
        f"one in {DATA_DIR / 'secret_key'} (`make run` writes one there on first run); "
        "KVOPS_DEBUG=1 allows the public development key")


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = os.environ.get("KVOPS_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("KVOPS_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

# Behind a TLS-terminating proxy (KVOPS_HTTPS=1): secure cookies, HSTS, redirects to
# https, and the proxy's X-Forwarded-Proto trusted. The health and metrics probes stay
# reachable over plain http from inside the network.
HTTPS = env_bool("KVOPS_HTTPS", False)
if HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("KVOPS_HSTS_SECONDS", 31_536_000))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("KVOPS_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("KVOPS_HSTS_PRELOAD", True)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "channels",
    "kvops",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # last: it answers locked-out logins
]

# Login throttling (django-axes): after KVOPS_LOGIN_FAILURE_LIMIT failed logins for one
# username from one address, that pair is locked out for KVOPS_LOGIN_LOCKOUT_MINUTES (a
# 429 page); a successful login resets the count. Applies to the login page and the
# admin's; API tokens are not passwords and are not affected.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = int(os.environ.get("KVOPS_LOGIN_FAILURE_LIMIT", 5))
AXES_COOLOFF_TIME = float(os.environ.get("KVOPS_LOGIN_LOCKOUT_MINUTES", 15)) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False

ROOT_URLCONF = "kvops.urls"
ASGI_APPLICATION = "kvops.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [BASE_DIR / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]

_default_db = f"sqlite:///{DATA_DIR / 'kvops.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(os.environ.get("DATABASE_URL", _default_db),
                                              conn_max_age=0)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web server and engine workers write concurrently: WAL, a generous lock timeout,
    # and writers that queue for the file instead of sleeping in SQLite's busy handler.
    DATABASES["default"]["ENGINE"] = "kvops.sqlite"
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in ("UserAttributeSimilarityValidator", "MinimumLengthValidator",
                 "CommonPasswordValidator", "NumericPasswordValidator")]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
WHITENOISE_USE_FINDERS = True  # serve static/ without collectstatic

# Request bodies: prompts are bounded by the model's length; 2 MiB leaves room for chat.
DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ.get("KVOPS_MAX_BODY_BYTES", 2 * 1024 * 1024))

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "capacity": 200, "expiry": 30},
    },
}

REST_FRAMEWORK = {
    # Token first: a call without credentials gets a 401 with `WWW-Authenticate: Token`
    # (DRF answers with the first class's challenge; the session's has none: a 403).
    # It takes `Token <key>` and `Bearer <key>` alike, as /v1 does.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "kvops.api.auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "kvops.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "kvops.api.errors.exception_handler",
    # JSON bodies through kvops/intake/json_body.py's rules (as /v1's); forms for the browsable API
    "DEFAULT_PARSER_CLASSES": ["kvops.intake.json_body.JSONParser",
                               "rest_framework.parsers.FormParser",
                               "rest_framework.parsers.MultiPartParser"],
    # Job submissions per user (kvops/jobs/throttles.py; staff exempt): REST and /v1 alike.
    "DEFAULT_THROTTLE_RATES": {"jobs": os.environ.get("KVOPS_JOB_RATE", "3000/min") or None},
}
# One prompt's characters (the token limit is the model's) and one answer's tokens
KVOPS_MAX_PROMPT_CHARS = int(os.environ.get("KVOPS_MAX_PROMPT_CHARS", 200_000))
KVOPS_MAX_TOKENS = int(os.environ.get("KVOPS_MAX_TOKENS", 8192))
# Prompts in one /v1/completions call (OpenAI's batch form: a job each).
KVOPS_MAX_BATCH_PROMPTS = int(os.environ.get("KVOPS_MAX_BATCH_PROMPTS", 256))
KVOPS_MAX_JOBS_PER_USER = int(os.environ.get("KVOPS_MAX_JOBS_PER_USER", 1024))  # 0: no cap
# and sequences: a job with `n` counts n (0: no cap); staff are exempt from both
KVOPS_MAX_SEQS_PER_USER = int(os.environ.get("KVOPS_MAX_SEQS_PER_USER", 1024))
# The most of an engine's max_num_seqs one non-staff user may hold while others wait
# (EngineConfig.max_batch_share; KVOPS_ENGINE_MAX_BATCH_SHARE for one engine); 1: no limit
KVOPS_MAX_BATCH_SHARE = float(os.environ.get("KVOPS_MAX_BATCH_SHARE", 0.5))
# Prefix-cache isolation: `user` (each non-staff user's own cache; staff and pinned
# prefixes shared) or `global` (one cache for all). See kvops/routing/tenancy.py.
KVOPS_PREFIX_SHARING = os.environ.get("KVOPS_PREFIX_SHARING", "user")
if KVOPS_PREFIX_SHARING not in ("user", "global"):
    from django.core.exceptions import ImproperlyConfigured
    raise ImproperlyConfigured(f"KVOPS_PREFIX_SHARING={KVOPS_PREFIX_SHARING!r}: use `user` "
                               "or `global`")

# The cache holds the rate limits' counts: in Redis, so every web process shares them.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                      "LOCATION": REDIS_URL, "KEY_PREFIX": "kvops:cache",
                      "OPTIONS": {"socket_connect_timeout": 2, "socket_timeout": 2}}}
SPECTACULAR_SETTINGS = {
    "TITLE": "kvops API",
    # Swagger UI shows the description as Markdown: the link leads back to the pages.
    "DESCRIPTION": "Jobs, engines and operator actions of a kvops deployment (/api), and "
                   "its OpenAI-compatible routes (/v1, /tokenize, /detokenize). Every route "
                   "takes an API key as `Authorization: Bearer <key>` or `Token <key>`. "
                   "Errors on /api are `{\"error\": {\"type\", \"code\", \"message\", "
                   "\"field\", \"fields\"}}`; on /v1, OpenAI's error object.\n\n"
                   "[← Back to the console](/)",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from this server (drf-spectacular-sidecar), not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # the OpenAI-compatible routes are plain Django views: described by hand there
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "kvops.openai.schema.add_openai_paths"],
}

# Celery: see kvops/celery.py (its broker is REDIS_URL through kvops/infra/broker.py).
CELERY_RESULT_BACKEND = None
# Structured-output constraints are compiled before their job is stored, in this many
# processes per web process, each compile within this deadline (kvops/intake/grammar_check.py)
KVOPS_GRAMMAR_WORKERS = max(1, int(os.environ.get("KVOPS_GRAMMAR_WORKERS", 2)))
KVOPS_GRAMMAR_TIMEOUT_S = float(os.environ.get("KVOPS_GRAMMAR_TIMEOUT_S", 5))
KVOPS_JOB_TIMEOUT_S = int(os.environ.get("KVOPS_JOB_TIMEOUT_S", 3600))
# Celery (kvops/celery.py): the broker is REDIS_URL through kvops/infra/broker.py's transport;
# Redis redelivers an unacknowledged message after the visibility timeout: longer than
# any job.
CELERY_BROKER_URL = broker_url(REDIS_URL)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": KVOPS_JOB_TIMEOUT_S + 300}
KVOPS_CONTROL_TIMEOUT_S = float(os.environ.get("KVOPS_CONTROL_TIMEOUT_S", 5))
# How jobs that name no engine are spread: `prefix` (the engine caching the longest
# prefix of the prompt), `round-robin` or `shared` (kvops/routing/routing.py).
KVOPS_ROUTING = os.environ.get("KVOPS_ROUTING", "prefix")
# An engine worker (python manage.py engine_worker sets KVOPS_ENGINE_WORKER=1 and the
# name). The engine's own settings are EngineConfig's fields, each read from
# KVOPS_ENGINE_<FIELD> (kvops/engines/engine_config.py); these are the worker's, not fields.
KVOPS_ENGINE_WORKER = os.environ.get("KVOPS_ENGINE_WORKER") == "1"
KVOPS_ENGINE_NAME = os.environ.get("KVOPS_ENGINE_NAME", "default")
KVOPS_ENGINE_CORE = os.environ.get("KVOPS_ENGINE_CORE", "process")  # or `thread`
# The core process's niceness (unset: engine.core_proc.CORE_NICE, -19 where allowed).
KVOPS_ENGINE_CORE_NICE = int(os.environ["KVOPS_ENGINE_CORE_NICE"]) \
    if os.environ.get("KVOPS_ENGINE_CORE_NICE") else None
# This deployment's id (kvops/engines/stack_id.py): unset, the one stored in its database on first
# use. Engine names are claimed per stack on the shared Redis database, and operator
# commands carry it: a worker ignores another stack's.
KVOPS_STACK_ID = os.environ.get("KVOPS_STACK_ID", "").strip()
if KVOPS_STACK_ID and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", KVOPS_STACK_ID):
    from django.core.exceptions import ImproperlyConfigured
    raise ImproperlyConfigured(f"KVOPS_STACK_ID={KVOPS_STACK_ID!r}: use 1 to 64 letters, "
                               "digits, '.', '_' or '-'")
KVOPS_PORT = int(os.environ.get("KVOPS_PORT", 8000))
# Proxies (addresses or networks, comma-separated) whose X-Forwarded-For the web server
# believes; none by default (kvops/infra/run.py, web_server_argv).
KVOPS_TRUSTED_PROXIES = os.environ.get("KVOPS_TRUSTED_PROXIES", "").strip()
KVOPS_LOG_LEVEL = os.environ.get("KVOPS_LOG_LEVEL", "INFO")
# A what-if replay (kvops/what_if/what_if.py, on the ops worker) that runs longer is stopped and
# marked failed.
KVOPS_WHAT_IF_TIME_LIMIT_S = float(os.environ.get("KVOPS_WHAT_IF_TIME_LIMIT_S", 600))
# Server-sent-event chunks one web process sends per second, at most, over all its
# streams: each stream's chunks are spaced by (streams / this) seconds, and the tokens
# produced meanwhile travel together (as vLLM's stream interval does).
KVOPS_SSE_MAX_CHUNKS_PER_S = float(os.environ.get("KVOPS_SSE_MAX_CHUNKS_PER_S", 6400))
# A streaming client that reads nothing for this long while its job produces is cut off
# and its job cancelled (kvops/stream/stream_hub.py).
KVOPS_STREAM_STALL_S = float(os.environ.get("KVOPS_STREAM_STALL_S", 30))
# Job-stream updates a worker aims at per second over all its jobs
# (kvops/worker/output_processor.py).
KVOPS_STREAM_UPDATES_PER_S = float(os.environ.get("KVOPS_STREAM_UPDATES_PER_S", 10_000))
KVOPS_HEARTBEAT_S = float(os.environ.get("KVOPS_HEARTBEAT_S", 2))
KVOPS_ENGINE_DEAD_AFTER_S = float(os.environ.get("KVOPS_ENGINE_DEAD_AFTER_S", 15))
# /metrics answers `Authorization: Bearer <this>` (when set) and staff, nobody else...
KVOPS_METRICS_TOKEN = os.environ.get("KVOPS_METRICS_TOKEN", "")
# ...unless it is made public on purpose (1: anyone may scrape, as before)
KVOPS_METRICS_PUBLIC = env_bool("KVOPS_METRICS_PUBLIC", False)
# A queued job whose task has not reached the broker this long after its commit is sent
# by the reaper (the send failed, or the web process died before it).
KVOPS_OUTBOX_AFTER_S = float(os.environ.get("KVOPS_OUTBOX_AFTER_S", 10))
# A job still queued this long after its task was sent gets the task sent again, same
# id (a message lost by the broker; the first delivery to claim it runs it).
KVOPS_RESEND_AFTER_S = float(os.environ.get("KVOPS_RESEND_AFTER_S", 900))
KVOPS_EVENT_HISTORY = int(os.environ.get("KVOPS_EVENT_HISTORY", 10_000))  # KV events kept per engine
KVOPS_METRICS_HISTORY = int(os.environ.get("KVOPS_METRICS_HISTORY", 3600))  # metric points (1/s)
# The engine page's timeline (kvops/dashboard/timeline.py): how far back each engine's KV history
# reaches, the most it may take in Redis, and how often a keyframe (a full snapshot)
# starts a window of it.
KVOPS_TIMELINE_SECONDS = float(os.environ.get("KVOPS_TIMELINE_SECONDS", 300))
KVOPS_TIMELINE_BYTES = int(os.environ.get("KVOPS_TIMELINE_BYTES", 96 * 2**20))
KVOPS_TIMELINE_KEYFRAME_S = float(os.environ.get("KVOPS_TIMELINE_KEYFRAME_S", 5))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": KVOPS_LOG_LEVEL},
    "loggers": {"uvicorn": {"level": "WARNING"}, "django.channels.server": {"level": "WARNING"},
                # Celery's two lines per task (received, succeeded): at hundreds of jobs a
                # second their handler's lock is contended by every job thread. Failures
                # are still logged; KVOPS_LOG_TASKS=1 brings the lines back.
                **{name: {"level": "INFO" if env_bool("KVOPS_LOG_TASKS", False) else "WARNING"}
                   for name in ("celery.app.trace", "celery.worker.strategy")}},
}
