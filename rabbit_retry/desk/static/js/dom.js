// Building the page without ever parsing data as HTML: every string from the desk (a body, a
// header, an exception message) becomes a text node or an attribute value, never markup.
// Nothing in the page uses innerHTML, outerHTML, insertAdjacentHTML or document.write.

// Attributes set as DOM properties (their state, not their initial value).
const PROPERTIES = new Set(["checked", "disabled", "value", "selected", "indeterminate"]);

// h("a", {href: "#/x", class: "link", onclick: fn}, "text", child, [more]) -> an element.
export function h(tag, attrs, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") element.className = value;
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (PROPERTIES.has(name)) element[name] = value;
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

export function append(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return parent;
}

// Empties `parent` and fills it with `children`.
export function fill(parent, ...children) {
  parent.replaceChildren();
  return append(parent, children);
}

export function $(selector, root = document) {
  return root.querySelector(selector);
}

const NUMBER = new Intl.NumberFormat();

export function count(n) {
  return typeof n === "number" ? NUMBER.format(n) : "—";
}

// plural(1, "message") -> "1 message"; plural(3, "message") -> "3 messages"
export function plural(n, one, many = `${one}s`) {
  return `${count(n)} ${n === 1 ? one : many}`;
}

function two(n) {
  return String(n).padStart(2, "0");
}

// A Date as "2026-11-02 10:00:00 UTC": every time on the page in one zone, the one the headers
// (parked-at) and the logs use, and saying so.
export function utc(date) {
  return `${date.getUTCFullYear()}-${two(date.getUTCMonth() + 1)}-${two(date.getUTCDate())} `
    + `${two(date.getUTCHours())}:${two(date.getUTCMinutes())}:${two(date.getUTCSeconds())} UTC`;
}

// A moment from the API (ISO 8601) in UTC, the browser's local time in the tooltip.
export function when(iso) {
  if (!iso) return h("span", { class: "muted" }, "—");
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return h("span", {}, String(iso));
  return h("time", { datetime: iso, title: `${date.toLocaleString()} (this browser's time)` },
    utc(date));
}

// "12 s", "3 min 5 s", "2 h 4 min": a duration in seconds, for estimates.
export function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "—";
  let s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  const h = Math.floor(s / 3600);
  s -= h * 3600;
  const m = Math.floor(s / 60);
  s -= m * 60;
  return h ? `${h} h ${m} min` : `${m} min ${s} s`;
}

// "3 min", "2 h 5 min", "4 d 3 h": how long ago `iso` was.
export function age(iso, now = Date.now()) {
  if (!iso) return "—";
  const then = new Date(iso).getTime();
  if (Number.isNaN(then)) return "—";
  let seconds = Math.max(0, Math.round((now - then) / 1000));
  if (seconds < 60) return `${seconds} s`;
  const days = Math.floor(seconds / 86400);
  seconds -= days * 86400;
  const hours = Math.floor(seconds / 3600);
  seconds -= hours * 3600;
  const minutes = Math.floor(seconds / 60);
  if (days > 0) return hours > 0 ? `${days} d ${hours} h` : `${days} d`;
  if (hours > 0) return minutes > 0 ? `${hours} h ${minutes} min` : `${hours} h`;
  return `${minutes} min`;
}

// A header or property value as text: strings as they are, anything else as JSON.
export function asText(value) {
  if (typeof value === "string") return value;
  try {
    return JSON.stringify(value, null, 2);
  } catch {
    return String(value);
  }
}

// `text` cut to `max` characters, with an ellipsis when it was longer.
export function shorten(text, max) {
  const s = text == null ? "" : String(text);
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

// A two-column table of `entries` ([name, value] pairs), values as text.
export function pairs(entries, emptyText) {
  if (entries.length === 0) return h("p", { class: "muted" }, emptyText);
  return h(
    "table",
    { class: "pairs" },
    h(
      "tbody",
      {},
      entries.map(([name, value]) =>
        h("tr", {}, h("th", { scope: "row" }, name), h("td", {}, h("pre", {}, asText(value))))
      )
    )
  );
}
