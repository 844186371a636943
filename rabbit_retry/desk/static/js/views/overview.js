// Overview: how much is parked, where and why, how old the oldest is, and what was done so far.

import { call } from "../api.js";
import { age, count, h, when } from "../dom.js";

function card(label, value, detail, id) {
  return h("div", { class: "card", id }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, value), detail ? h("div", { class: "detail" }, detail) : null);
}

export async function renderOverview(ctx) {
  const o = await call("/api/overview");
  const queues = o.queues || [];
  const rows = queues.map((q) => {
    const reasons = Object.entries(q.by_reason || {}).sort((a, b) => b[1] - a[1]);
    return h("tr", { dataset: { queue: q.queue } },
      h("td", {}, h("a", { href: ctx.link("groups", { queue: q.queue }) }, q.queue)),
      h("td", { class: "num" },
        h("a", { href: ctx.link("messages", { queue: q.queue }) }, count(q.parked))),
      h("td", {}, reasons.length
        ? h("ul", { class: "chips" }, reasons.map(([reason, n]) =>
          h("li", { class: `chip reason-${reason.replace(/[^a-z0-9-]/gi, "")}` }, reason, " ",
            h("b", {}, count(n)))))
        : h("span", { class: "muted" }, "—")));
  });
  return [
    h("h2", {}, "Overview"),
    h("div", { class: "cards" },
      card("Parked", count(o.parked), "waiting for an operator", "card-parked"),
      card("Oldest parked", o.oldest_parked_at ? age(o.oldest_parked_at) : "—",
        o.oldest_parked_at ? ["since ", when(o.oldest_parked_at)] : "nothing parked", "card-oldest"),
      card("Replayed", count(o.replayed),
        o.replaying ? `${count(o.replaying)} still being replayed` : "sent back to a queue",
        "card-replayed"),
      card("Discarded", count(o.discarded), "never to be replayed", "card-discarded"),
      o.outbox ? h("a", { href: ctx.link("outbox"), class: "card-link" },
        card("Outbox dead", count(o.outbox.dead),
          o.outbox.failed ? `${count(o.outbox.failed)} failed, tried again` : "events the broker refused",
          "card-outbox")) : null),
    h("h3", {}, "Parked by queue and reason"),
    queues.length
      ? h("table", { class: "grid", id: "overview-queues" },
        h("thead", {}, h("tr", {}, h("th", {}, "Queue"), h("th", { class: "num" }, "Parked"),
          h("th", {}, "By reason"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, "Nothing is parked."),
    h("p", {}, h("a", { href: ctx.link("groups") }, "See why they parked, grouped by cause →")),
  ];
}
