// Held keys: the ordered keys a parked message holds (on_park: hold). The key's later messages
// wait until an operator replays the message (it goes first, the rest follow in order) or
// discards it (the rest follow). Each row links to the message holding the key.

import { call, withQuery } from "../api.js";
import { age, count, h, shorten, when } from "../dom.js";

const PAGE = 100;

export async function renderHeld(ctx) {
  const queue = ctx.params.get("queue") || "";
  let offset = Number.parseInt(ctx.params.get("offset") || "", 10);
  if (!Number.isFinite(offset) || offset < 0) offset = 0;
  const held = await call(withQuery("/api/held", { queue, limit: PAGE, offset }));
  const items = held.items || [];
  const here = (over = {}) => ctx.link("held", { queue, offset: offset || "", ...over });
  const perQueue = (held.queues || []).map((q) => h("li", { class: "chip" },
    h("a", { href: ctx.link("held", { queue: q.queue }) }, q.queue), " ", h("b", {}, count(q.held_keys))));
  const rows = items.map((k) => h("tr", { dataset: { message: String(k.message) } },
    h("td", { class: "queue" }, k.queue),
    h("td", { class: "ids" }, h("code", { class: "held-key" }, k.key ?? "")),
    h("td", { class: "ids" }, h("a", { href: `#/message/${encodeURIComponent(k.message)}`, class: "open" },
      k.message_id || `#${k.message}`)),
    h("td", { class: "time" }, when(k.since), h("div", { class: "muted" }, `${age(k.since)} ago`)),
    h("td", { class: "exception" }, h("div", { class: "type" }, k.exception_type || ""),
      h("div", { class: "message" }, shorten(k.exception_message, 160)))));
  return [
    h("h2", {}, "Held keys"),
    h("p", { class: "muted" }, "A parked message of an ordered queue holds its key: the key's later "
      + "messages wait for it. Replay it (it goes first, the rest follow in order) or discard it "
      + "(the rest follow) from the message's page."),
    perQueue.length ? h("ul", { class: "chips", id: "held-queues" }, perQueue) : null,
    queue ? h("p", { class: "scope" }, "Only queue ", h("code", {}, queue), " ",
      h("a", { href: ctx.link("held") }, "show every queue")) : null,
    items.length
      ? h("table", { class: "grid", id: "held" },
        h("thead", {}, h("tr", {}, h("th", {}, "Queue"), h("th", {}, "Key"),
          h("th", {}, "Held by"), h("th", {}, "Since"), h("th", {}, "Exception"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, "No key is held."),
    h("nav", { class: "pager", "aria-label": "pages" },
      h("span", {}, `${count(held.total || 0)} held`),
      offset > 0 ? h("a", { href: here({ offset: Math.max(0, offset - PAGE) || "" }) }, "‹ previous") : null,
      offset + items.length < (held.total || 0) ? h("a", { href: here({ offset: offset + PAGE }) }, "next ›") : null),
  ];
}
