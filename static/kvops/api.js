// The REST API from the pages: session cookie + CSRF token, JSON in and out.

function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  if (match) return decodeURIComponent(match[1]);
  const input = document.querySelector("input[name=csrfmiddlewaretoken]");
  return input ? input.value : "";
}

// Returns {status, ok, data}; never throws for an HTTP error (the caller shows it).
export async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
  if (method !== "GET") {
    init.headers["X-CSRFToken"] = csrfToken();
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body ?? {});
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    return { status: 0, ok: false, data: { error: `network error: ${e.message}` } };
  }
  let data = null;
  const text = await response.text();
  try { data = text ? JSON.parse(text) : null; } catch { data = { error: text.slice(0, 500) }; }
  return { status: response.status, ok: response.ok, data };
}

// One line saying what went wrong, from any of the API's error shapes.
export function errorText(result) {
  const d = result.data;
  if (!d) return `HTTP ${result.status}`;
  if (typeof d === "string") return d;
  if (d.message) return `${d.error ? d.error + ": " : ""}${d.message}`;
  if (d.error) return typeof d.error === "string" ? d.error : JSON.stringify(d.error);
  if (d.detail) return d.detail;
  return Object.entries(d).map(([k, v]) => `${k}: ${Array.isArray(v) ? v.join(" ") : v}`).join("; ");
}
