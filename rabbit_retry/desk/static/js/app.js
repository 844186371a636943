// The failure desk's page: a hash router over its views (overview, groups, one group, messages,
// one message, held keys, an application's outbox and one of its events, audit), who is signed in (as the desk authenticated them: the page sends no name
// of its own), and the lines that report what happened.

import { call, withQuery } from "./api.js";
import { setUpDialogs } from "./dialogs.js";
import { $, fill, h } from "./dom.js";
import { renderAudit } from "./views/audit.js";
import { renderGroup } from "./views/group.js";
import { renderGroups } from "./views/groups.js";
import { renderHeld } from "./views/held.js";
import { renderMessage } from "./views/message.js";
import { renderMessages } from "./views/messages.js";
import { renderOutbox } from "./views/outbox.js";
import { renderOverview } from "./views/overview.js";

const VIEWS = {
  overview: renderOverview,
  groups: renderGroups,
  group: renderGroup,
  messages: renderMessages,
  message: renderMessage,
  held: renderHeld,
  outbox: renderOutbox,
  audit: renderAudit,
};
const PARENT = { message: "messages", group: "groups" };

let generation = 0; // which render is current: a slow answer for a view left behind is dropped
let queuesCache = null;
let lastList = "#/messages"; // the message list last shown, filters and page included
let me = { name: "?", role: "viewer", may_act: false };

// "#/messages?queue=a&offset=50" -> {name: "messages", arg: "", params: URLSearchParams}
// "#/message/42" -> {name: "message", arg: "42", ...}
function parseHash() {
  const raw = window.location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?", 2);
  const [name, ...rest] = path.split("/");
  let arg = rest.join("/");
  try {
    arg = decodeURIComponent(arg);
  } catch {
    // a malformed escape: the view gets it as typed, and the desk says what is wrong with it
  }
  return { name: VIEWS[name] ? name : "overview", arg, params: new URLSearchParams(query) };
}

// "#/messages" + {queue: "a", q: ""} -> "#/messages?queue=a"
function link(view, params = {}) {
  return withQuery(`#/${view}`, params);
}

function go(hash) {
  if (window.location.hash === hash) navigate();
  else window.location.hash = hash;
}

function notify(text) {
  const line = $("#notice");
  line.textContent = text;
  line.hidden = !text;
}

function fail(error) {
  const line = $("#error");
  const text = error ? (error.message || String(error)) : "";
  line.textContent = text;
  line.hidden = !text;
}

// The topology's queues, loaded once a page load (Refresh loads them again).
async function queues() {
  if (!queuesCache) queuesCache = call("/api/queues");
  try {
    return await queuesCache;
  } catch (error) {
    queuesCache = null;
    throw error;
  }
}

async function render() {
  const mine = ++generation;
  const { name, arg, params } = parseHash();
  for (const a of document.querySelectorAll("nav a[data-view]")) {
    const current = a.dataset.view === name || a.dataset.view === PARENT[name];
    if (current) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (name === "messages") lastList = window.location.hash;
  const view = $("#view");
  view.dataset.view = name;
  view.setAttribute("aria-busy", "true");
  const ctx = {
    arg,
    params,
    queues,
    link,
    go,
    notify,
    fail,
    me: () => me,
    rerender: render,
    current: () => mine === generation,
    backToList: () => lastList,
  };
  try {
    const nodes = await VIEWS[name](ctx);
    if (!ctx.current()) return;
    fill(view, nodes);
  } catch (error) {
    if (!ctx.current()) return;
    fill(view, h("p", { class: "muted" }, "This view could not be loaded."));
    fail(error);
  } finally {
    if (ctx.current()) {
      view.setAttribute("aria-busy", "false");
      view.dataset.loaded = String(mine);
    }
  }
}

// Who the desk says is at the page, what they may do, whether the desk runs without any
// credentials (loopback only) and whether it consumes every parking queue: said on every view.
async function showWho() {
  try {
    me = await call("/api/me");
  } catch {
    return; // the view's own request reports the error
  }
  $("#who-name").textContent = me.name;
  $("#who-role").textContent = me.role;
  document.body.dataset.role = me.role;
  $("#logout").hidden = !me.logout;
  $("#auth-banner").hidden = !me.loopback;
  $('nav a[data-view="outbox"]').hidden = !me.outbox;
  try {
    const overview = await call("/api/overview");
    $("#consuming-banner").hidden = overview.consuming !== false;
  } catch {
    // the view's own request reports the error
  }
}

async function logout() {
  try {
    await call("/logout", {});
  } catch (error) {
    fail(error);
    return;
  }
  window.location.assign("/login");
}

setUpDialogs();
// Going somewhere (or loading the view again) starts with no old notice or error on screen; an
// action's own re-render keeps the lines that report it.
function navigate() {
  notify("");
  fail(null);
  render();
}

$("#logout").addEventListener("click", logout);
$("#refresh").addEventListener("click", () => {
  queuesCache = null;
  navigate();
});
window.addEventListener("hashchange", navigate);
// A link to the view on screen loads it again (the browser sees no change of address).
document.addEventListener("click", (event) => {
  const a = event.target instanceof Element ? event.target.closest('a[href^="#"]') : null;
  if (a && a.getAttribute("href") === window.location.hash && event.button === 0) {
    event.preventDefault();
    navigate();
  }
});
showWho().then(render);
