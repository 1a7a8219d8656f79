"""The engine page's KV by tenant panel in headless Chromium against the real stack
(uvicorn, a simulated engine worker, Redis, SQLite): two plain users' jobs leave blocks
cached; staff read both tenants by user name, and each plain user reads their own row
as "you" and the other's only added up into "others", nowhere by name or label."""
from pathlib import Path

import pytest

from tests.support.stack import Stack

playwright = pytest.importorskip("playwright.sync_api")
ENGINE = "tnt"
PASSWORD = "ochre-lantern-52-reef"
USERS = ("cara", "dmitri")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("tenant-browser")))
    try:
        s.start_web()
        s.start_engine(ENGINE, simulate=1, block_size=4, num_gpu_blocks=1024, num_cpu_blocks=0)
        s.labels = {user: add_user(s, user) for user in USERS}
        for user, n in zip(USERS, (24, 8)):  # cara's prompt is the longer: more blocks
            run_job(s, user, n)
        yield s
    finally:
        s.stop()


def add_user(stack, user: str) -> str:
    """A plain user with an API token; their tenant label."""
    out = stack.manage("shell", "-c", "from django.contrib.auth.models import User; "
                       "from kvops.routing import tenancy; "
                       f"u = User.objects.create_user('{user}', password='{PASSWORD}'); "
                       "print(tenancy.tenant(u))")
    stack.tokens[user] = stack.manage("drf_create_token", user).split()[2]
    return out.split()[-1]


def run_job(stack, user: str, n: int) -> None:
    job = stack.api("POST", "/api/jobs/", user=user, json={
        "prompt": f"{user}'s own prompt, " * n, "max_tokens": 4, "engine": ENGINE}).json()
    assert stack.wait_job(job["id"], user=user)["status"] == "finished"


def test_staff_read_the_engines_tenants_with_their_users(stack):
    stack.wait(lambda: set(stack.labels.values()) <= tenants_heartbeat(stack),
               "both tenants' cached blocks in the engine's heartbeat", 30)
    r = stack.api("GET", f"/api/engines/{ENGINE}/tenants/")
    assert r.status_code == 200, r.text
    users = {row["tenant"]: row["user"] for row in r.json()["tenants"]}
    assert users[stack.labels["cara"]] == "cara" and users[stack.labels["dmitri"]] == "dmitri"
    assert stack.api("GET", f"/api/engines/{ENGINE}/tenants/", user="cara").status_code == 403
    assert stack.api("GET", "/api/engines/nope/tenants/").status_code == 404


def tenants_heartbeat(stack) -> set:
    rows = stack.api("GET", f"/api/engines/{ENGINE}/").json()["engine"]["metrics"] \
        .get("kv_by_tenant", {}).get("tenants", [])
    return {r["tenant"] for r in rows if r["cached_blocks"] > 0}


def panel_rows(page) -> list[list[str]]:
    page.wait_for_selector("#tenant-kv table.tenant-kv")
    return page.eval_on_selector_all(
        "#tenant-kv tbody tr", "rows => rows.map(r => [r.dataset.tenant, "
        "...Array.from(r.cells, c => c.textContent.trim())])")


def test_staff_read_every_tenant_by_name_and_plain_users_their_own(login, stack):
    labels = stack.labels
    stack.wait(lambda: set(labels.values()) <= tenants_heartbeat(stack),
               "both tenants' cached blocks in the engine's heartbeat", 30)

    page, errors = login(stack, "admin", "admin-pass-123")
    page.goto(f"{stack.url}/engines/{ENGINE}/")
    page.wait_for_function("document.querySelector('#tenant-kv').textContent.includes('dmitri')")
    rows = {row[0]: row for row in panel_rows(page)}
    assert rows[labels["cara"]][1] == "cara" and rows[labels["dmitri"]][1] == "dmitri"
    cached = {user: int(rows[labels[user]][4].replace(",", "")) for user in USERS}
    assert cached["cara"] > cached["dmitri"] > 0
    # the map by tenant: the cached blocks (all of them cara's or dmitri's) leave the
    # cached grey for their tenants' two tints
    colours = """() => { const c = document.querySelector('#gpu-map');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const seen = new Set(); for (let i = 0; i < d.length; i += 4) seen.add(d[i] << 16 | d[i + 1] << 8 | d[i + 2]);
        return [...seen]; }"""
    grey = 0x9AA6B8  # static/kvops/colors.js CSS.cached
    page.wait_for_function(f"({colours})().includes({grey})")
    before = set(page.evaluate(colours))
    page.select_option("#colour-by", "tenant")
    page.wait_for_function(f"!({colours})().includes({grey})")
    assert len(set(page.evaluate(colours)) - before) >= 2
    # a tenant that comes after the page loaded is named too (the page asks for it)
    label = add_user(stack, "ezra")
    run_job(stack, "ezra", 30)
    page.wait_for_function("document.querySelector('#tenant-kv').textContent.includes('ezra')",
                           timeout=60_000)
    assert label not in page.inner_text("#tenant-kv")
    assert not errors, errors

    for user, other in (("cara", "dmitri"), ("dmitri", "cara")):
        page, errors = login(stack, user, PASSWORD)
        page.goto(f"{stack.url}/engines/{ENGINE}/")
        page.wait_for_function("document.querySelector('#tenant-kv').textContent.includes('others')")
        rows = panel_rows(page)
        assert [(r[0], r[1]) for r in rows] == [(labels[user], "you"), ("other", "others")]
        assert int(rows[0][4].replace(",", "")) == cached[user]
        assert int(rows[1][4].replace(",", "")) >= cached[other]
        assert labels[other] not in page.content() and other not in page.inner_text("#tenant-kv")
        assert page.locator(f"#tenant-kv tr.mine[data-tenant='{labels[user]}']").count() == 1
        assert not errors, errors
