// Groups: parked messages that failed for the same cause (queue, reason, exception type and
// normalised message), the way to replay or discard many at once.

import { call, withQuery } from "../api.js";
import { discard, replay, report } from "../dialogs.js";
import { count, h, shorten, when } from "../dom.js";
import { filterForm, queueOptions, statusOptions, statusParam } from "./filters.js";

export async function renderGroups(ctx) {
  const queue = ctx.params.get("queue") || "";
  const status = statusParam(ctx.params);
  const [groups, queues] = await Promise.all([
    call(withQuery("/api/groups", { queue, status })),
    ctx.queues(),
  ]);

  const queueSelect = h("select", { name: "queue", id: "groups-queue" }, queueOptions(queues, queue));
  const statusSelect = h("select", { name: "status", id: "groups-status" }, statusOptions(ctx.params, { any: false }));
  const form = filterForm("groups-filter", [
    h("label", {}, "Queue ", queueSelect),
    h("label", {}, "Status ", statusSelect),
  ], () => ctx.go(ctx.link("groups", { queue: queueSelect.value, status: statusSelect.value })));
  for (const select of [queueSelect, statusSelect]) {
    select.addEventListener("change", () => form.requestSubmit());
  }

  const actionable = status === "parked";
  async function act(kind, group) {
    const result = kind === "replay"
      ? await replay({ group }, queues)
      : await discard({ group });
    if (!result) return;
    report(ctx, result);
    ctx.rerender();
  }

  const rows = groups.map((g) => h("tr", { dataset: { group: g.id } },
    h("td", {}, g.queue),
    h("td", {}, h("span", { class: `chip reason-${String(g.reason).replace(/[^a-z0-9-]/gi, "")}` }, g.reason)),
    h("td", { class: "exception" },
      h("div", { class: "type" }, g.exception_type || "(no exception)"),
      h("div", { class: "message", title: g.exception_message || "" },
        shorten(g.exception_message, 240)),
      g.sample && g.sample !== g.exception_message
        ? h("div", { class: "sample muted", title: g.sample }, "e.g. ", shorten(g.sample, 160))
        : null),
    h("td", { class: "num" }, h("a", {
      href: ctx.link("messages", { group: g.id, queue: g.queue, status: ctx.params.get("status") }),
      class: "count",
    }, count(g.count))),
    h("td", {}, when(g.first_parked_at)),
    h("td", {}, when(g.last_parked_at)),
    h("td", { class: "actions" },
      h("a", { href: ctx.link("messages", { group: g.id, queue: g.queue, status: ctx.params.get("status") }) }, "Messages"),
      actionable ? h("button", { type: "button", class: "replay", onclick: () => act("replay", g).catch(ctx.fail) }, "Replay…") : null,
      actionable ? h("button", { type: "button", class: "discard danger", onclick: () => act("discard", g).catch(ctx.fail) }, "Discard…") : null)));

  return [
    h("h2", {}, "Groups by cause"),
    form,
    groups.length
      ? h("table", { class: "grid", id: "groups" },
        h("thead", {}, h("tr", {},
          h("th", {}, "Queue"), h("th", {}, "Reason"), h("th", {}, "Exception"),
          h("th", { class: "num" }, "Messages"), h("th", {}, "First parked"),
          h("th", {}, "Last parked"), h("th", {}, ""))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, status === "parked" ? "Nothing is parked." : "No groups."),
  ];
}
