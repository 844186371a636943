// The desk's JSON API as the page calls it: the CSRF header on every change, one error line
// from the server shown as it is, and the login page when a session ends. Who acts is whoever
// the session (or the proxy) authenticated: the page sends no name of its own.

const CSRF_COOKIE = "rabbit_retry_csrf";

function cookie(name) {
  for (const part of document.cookie.split(";")) {
    const [key, ...rest] = part.trim().split("=");
    if (key === name) return decodeURIComponent(rest.join("="));
  }
  return "";
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function send(path, method, body) {
  const headers = { Accept: "application/json" };
  const init = { method, headers, credentials: "same-origin", cache: "no-store" };
  if (method !== "GET") {
    const token = cookie(CSRF_COOKIE);
    if (token) headers["X-CSRF-Token"] = token;
  }
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch {
    throw new ApiError(0, "the desk does not answer (is it still running?)");
  }
  // A view that may not be read: the session is over, log in again. A refused action stays on
  // screen with the desk's reason, so the operator knows it did not happen.
  if (response.status === 401 && method === "GET") {
    window.location.assign("/login");
    throw new ApiError(401, "not logged in");
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const reason = data && typeof data.error === "string" ? data.error : response.statusText;
    throw new ApiError(response.status, `${response.status}: ${reason || "request failed"}`);
  }
  return { data, response };
}

// GET (no body) or POST (JSON body) `path`; the parsed answer, or ApiError with the server's
// one-line reason.
export async function call(path, body) {
  const { data } = await send(path, body === undefined ? "GET" : "POST", body);
  return data;
}

// DELETE `path`.
export async function remove(path) {
  const { data } = await send(path, "DELETE");
  return data;
}

// GET a list whose total the desk sends in X-Total-Count: {items, total}.
export async function page(path) {
  const { data, response } = await send(path, "GET");
  const total = Number.parseInt(response.headers.get("X-Total-Count") || "", 10);
  return { items: data || [], total: Number.isFinite(total) ? total : (data || []).length };
}

// POST and tell a finished answer (200) from one still running (202): {data, status}.
export async function start(path, body) {
  const { data, response } = await send(path, "POST", body);
  return { data, status: response.status };
}

// "/api/messages" + {queue: "a", q: ""} -> "/api/messages?queue=a" (empty values left out);
// the page's own addresses ("#/messages?queue=a") are built the same way.
export function withQuery(path, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") query.set(key, String(value));
  }
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}
