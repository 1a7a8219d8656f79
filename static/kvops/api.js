// The REST API from the pages: session cookie + CSRF token, JSON in and out.

function csrfToken() {
  const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  if (match) return decodeURIComponent(match[1]);
  const input = document.querySelector("input[name=csrfmiddlewaretoken]");
  return input ? input.value : "";
}

// Returns {status, ok, data}; never throws for an HTTP error (the caller shows it).
// `headers`: more of them (an Idempotency-Key).
export async function api(method, path, body, headers = {}) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json", ...headers } };
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

// A fresh Idempotency-Key: a POST sent again with it (its answer never came) is answered
// with the first call's answer, and what it asked for happens once. (crypto.randomUUID
// needs HTTPS or localhost; getRandomValues works on any page.)
export function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
