"""Fixtures of the dashboard tests: users and a publishing simulated engine (for the
consumers), headless Chromium (Debian's chromium, driven by Playwright) and a logged-in
page (for the browser tests)."""
import shutil
import uuid
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")  # closed before other modules' asyncio tests run
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (make setup installs it)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture
def login(browser):
    """login(stack, user, password) -> (page, errors): a new browser context, logged in;
    errors collects the page's uncaught JavaScript errors."""
    contexts = []

    def open_page(stack, user: str, password: str):
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        contexts.append(context)
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{stack.url}/accounts/login/")
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", password)
        page.click("button[type=submit]")
        page.wait_for_url(f"{stack.url}/")
        return page, errors

    yield open_page
    for context in contexts:
        context.close()


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each test gets a channel layer of its own. channels-redis keeps the state of its
    receives (asyncio locks, bound to the loop that made them) in the layer, and each
    asyncio test runs its own event loop."""
    from channels.layers import channel_layers
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture
def users():
    from django.contrib.auth.models import User
    return (User.objects.create_user("op", is_staff=True), User.objects.create_user("alice"),
            User.objects.create_user("bob"))


@pytest.fixture
def engine_setup():
    """A simulated engine registered under a fresh name, with its publisher running:
    (name, engine, publisher, churn)."""
    from kvops.models import Engine
    from tests.dashboard.churn import Churn, churn_engine
    from tests.support.local_publisher import LocalPublisher
    from tests.support.wait import wait_until

    name = f"t{uuid.uuid4().hex[:8]}"
    engine = churn_engine(name=name)
    Engine.objects.create(name=name, worker=f"engine-{name}@test", status="ready",
                          config=engine.describe_config())
    publisher = LocalPublisher(name)
    churn = Churn(engine, seed=3)
    for _ in range(20):
        churn()
    publisher(engine)
    wait_until(lambda: publisher.mirror.seq, "the publisher's first capture", 10,
               until=lambda seq: seq >= 1)
    yield name, engine, publisher, churn
    publisher.close()
