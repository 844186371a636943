// The desk's JSON API as the page calls it: who acts (X-Actor), the CSRF header on every
// POST, one error line from the server shown as it is, and the login page when a session ends.

const ACTOR_KEY = "rabbit-retry-desk.actor";
const CSRF_COOKIE = "rabbit_retry_csrf";

// Header values must be ISO-8859-1 in fetch; a name is kept to printable ASCII so it reaches
// the audit exactly as typed.
export const ACTOR_PATTERN = "[A-Za-z0-9][A-Za-z0-9 ._@+\\-]{0,63}";
const ACTOR_RE = new RegExp(`^${ACTOR_PATTERN}$`);

export function actor() {
  try {
    const name = window.localStorage.getItem(ACTOR_KEY) || "";
    return ACTOR_RE.test(name) ? name : "";
  } catch {
    return "";
  }
}

export function setActor(name) {
  const clean = String(name).trim();
  if (!ACTOR_RE.test(clean)) throw new Error("a name of letters, digits, spaces and . _ @ + -");
  window.localStorage.setItem(ACTOR_KEY, clean);
  return clean;
}

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

// GET (no body) or POST (JSON body) `path`; the parsed answer, or ApiError with the server's
// one-line reason.
export async function call(path, body) {
  const headers = { Accept: "application/json" };
  const name = actor();
  if (name) headers["X-Actor"] = name;
  const init = { method: "GET", headers, credentials: "same-origin", cache: "no-store" };
  if (body !== undefined) {
    init.method = "POST";
    init.body = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
    const token = cookie(CSRF_COOKIE);
    if (token) headers["X-CSRF-Token"] = token;
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch {
    throw new ApiError(0, "the desk does not answer (is it still running?)");
  }
  // A view that may not be read: the session is over, log in again. A refused action stays on
  // screen with the desk's reason, so the operator knows it did not happen.
  if (response.status === 401 && init.method === "GET") {
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
  return data;
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
