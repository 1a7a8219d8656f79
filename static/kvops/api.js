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

// One line saying what went wrong. /api answers {"error": {type, code, message, field,
// fields}} (docs/api.md, "Errors"; /v1's OpenAI shape has a message there too); api()
// above makes {"error": "<text>"} of a network failure or a body that is not JSON.
export function errorText(result) {
  const d = result.data;
  if (!d) return `HTTP ${result.status}`;
  if (typeof d === "string") return d;
  const error = d.error;
  if (typeof error === "string") return error;
  if (error && error.message) return error.message;
  return `HTTP ${result.status}: ${JSON.stringify(d).slice(0, 300)}`;
}

// A fresh Idempotency-Key: a POST sent again with it (its answer never came) is answered
// with the first call's answer, and what it asked for happens once. (crypto.randomUUID
// needs HTTPS or localhost; getRandomValues works on any page.)
export function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
