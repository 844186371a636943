// Groups: parked messages that failed for the same cause (queue, reason, exception type and
// normalised message), a page at a time with the total, filtered by queue, status and text; the
// way to replay, discard or restore many at once; and the operators' own grouping rules.

import { call, page, remove, withQuery } from "../api.js";
import { discard, replay, report, restore } from "../dialogs.js";
import { count, h, plural, shorten, when } from "../dom.js";
import { filterForm, queueOptions, statusOptions, statusParam } from "./filters.js";

const PAGE = 50;

function offsetOf(params) {
  const offset = Number.parseInt(params.get("offset") || "", 10);
  return Number.isFinite(offset) && offset > 0 ? offset - (offset % PAGE) : 0;
}

// The operators' grouping rules: a list, a form to add one, a button to remove each.
function rulesPanel(ctx, rules, queues) {
  const mayAct = ctx.me().may_act;
  const pattern = h("input", { id: "rule-pattern", name: "pattern", maxlength: "200", size: "28",
    placeholder: "tenant [a-z]+", required: true, class: "code" });
  const name = h("input", { id: "rule-name", name: "name", maxlength: "24", size: "10",
    placeholder: "tenant", required: true, pattern: "[a-z][a-z_]{0,23}" });
  const queue = h("select", { id: "rule-queue", name: "queue" }, queueOptions(queues, ""));
  const form = h("form", { id: "rule-form", class: "filters" },
    h("label", {}, "Replace ", pattern), h("label", {}, "with <", name, ">"),
    h("label", {}, "in ", queue), h("button", { type: "submit", class: "primary" }, "Add rule"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const body = { pattern: pattern.value, name: name.value.trim() };
      if (queue.value) body.queue = queue.value;
      await call("/api/rules", body);
      ctx.notify(`Rule added: messages are regrouped in the background.`);
      ctx.rerender();
    } catch (error) {
      ctx.fail(error);
    }
  });
  const rows = rules.map((r) => h("tr", { dataset: { rule: String(r.id) } },
    h("td", {}, h("code", {}, r.pattern)), h("td", {}, h("code", {}, `<${r.name}>`)),
    h("td", {}, r.queue || "every queue"), h("td", {}, r.actor), h("td", {}, when(r.at)),
    h("td", {}, mayAct ? h("button", { type: "button", class: "remove-rule link", onclick: async () => {
      try {
        await remove(`/api/rules/${encodeURIComponent(r.id)}`);
        ctx.notify("Rule removed: messages are regrouped in the background.");
        ctx.rerender();
      } catch (error) {
        ctx.fail(error);
      }
    } }, "remove") : null)));
  return h("details", { id: "rules", open: rules.length > 0 },
    h("summary", {}, `Grouping rules (${rules.length})`),
    h("p", { class: "muted" }, "What a rule's regular expression matches in an exception message "
      + "becomes <name> before the built-in rules run (numbers, ids, times, addresses, queries)."),
    rules.length
      ? h("table", { class: "grid", id: "rules-table" }, h("thead", {}, h("tr", {},
        h("th", {}, "Pattern"), h("th", {}, "Becomes"), h("th", {}, "Queue"), h("th", {}, "Added by"),
        h("th", {}, "When"), h("th", {}, ""))), h("tbody", {}, rows))
      : null,
    mayAct ? form : null);
}

export async function renderGroups(ctx) {
  const queue = ctx.params.get("queue") || "";
  const status = statusParam(ctx.params) || "parked";
  const q = ctx.params.get("q") || "";
  const offset = offsetOf(ctx.params);
  const [groups, queues, rules] = await Promise.all([
    page(withQuery("/api/groups", { queue, status, q, limit: PAGE, offset })),
    ctx.queues(),
    call("/api/rules"),
  ]);

  const here = (over = {}) => ctx.link("groups", { queue, status: ctx.params.get("status"), q,
    offset: offset || "", ...over });
  const search = h("input", { type: "search", name: "q", id: "groups-q", value: q, size: "24",
    placeholder: "exception type or message" });
  const queueSelect = h("select", { name: "queue", id: "groups-queue" }, queueOptions(queues, queue));
  const statusSelect = h("select", { name: "status", id: "groups-status" }, statusOptions(ctx.params, { any: false }));
  const form = filterForm("groups-filter", [
    h("label", { class: "grow" }, "Cause ", search),
    h("label", {}, "Queue ", queueSelect),
    h("label", {}, "Status ", statusSelect),
    h("button", { type: "submit", class: "primary" }, "Filter"),
  ], () => ctx.go(here({ q: search.value.trim(), queue: queueSelect.value,
    status: statusSelect.value, offset: "" })));
  for (const select of [queueSelect, statusSelect]) {
    select.addEventListener("change", () => form.requestSubmit());
  }

  const mayAct = ctx.me().may_act;
  async function act(kind, group) {
    const result = kind === "replay" ? await replay({ group }, queues)
      : kind === "restore" ? await restore({ group }) : await discard({ group });
    if (!result) return;
    report(ctx, result);
    ctx.rerender();
  }
  function button(kind, label, group, danger) {
    return h("button", { type: "button", class: `${kind}${danger ? " danger" : ""}`,
      onclick: () => act(kind, group).catch(ctx.fail) }, label);
  }

  const rows = groups.items.map((g) => h("tr", { dataset: { group: g.id } },
    h("td", { class: "queue" }, g.queue),
    h("td", {}, h("span", { class: `chip reason-${String(g.reason).replace(/[^a-z0-9-]/gi, "")}` }, g.reason)),
    h("td", { class: "exception" },
      h("a", { href: `#/group/${encodeURIComponent(g.id)}`, class: "cause" },
        h("span", { class: "type" }, g.exception_type || "(no exception)")),
      h("div", { class: "message", title: g.exception_message || "" },
        shorten(g.exception_message, 240)),
      g.sample && g.sample !== g.exception_message
        ? h("div", { class: "sample muted", title: g.sample }, "e.g. ", shorten(g.sample, 160))
        : null,
      g.notes ? h("div", { class: "notes-count" }, plural(g.notes, "note")) : null),
    h("td", { class: "num" }, h("a", {
      href: ctx.link("messages", { group: g.id, queue: g.queue, status: ctx.params.get("status") }),
      class: "count",
    }, count(g.count))),
    h("td", { class: "time" }, when(g.first_parked_at)),
    h("td", { class: "time" }, when(g.last_parked_at)),
    h("td", { class: "actions" },
      mayAct && status === "parked" ? button("replay", "Replay…", g) : null,
      mayAct && status === "parked" ? button("discard", "Discard…", g, true) : null,
      mayAct && status === "discarded" ? button("restore", "Restore…", g) : null)));

  const last = Math.min(offset + groups.items.length, groups.total);
  const pager = h("nav", { class: "pager", "aria-label": "pages" },
    h("span", { id: "groups-range" }, groups.total
      ? `${count(offset + 1)}–${count(last)} of ${plural(groups.total, "group")}` : "0 groups"),
    offset > 0 ? h("a", { href: here({ offset: Math.max(0, offset - PAGE) || "" }), id: "groups-prev" }, "‹ previous") : null,
    last < groups.total ? h("a", { href: here({ offset: offset + PAGE }), id: "groups-next" }, "next ›") : null);

  return [
    h("h2", {}, "Groups by cause"),
    form,
    groups.items.length
      ? h("table", { class: "grid", id: "groups" },
        h("thead", {}, h("tr", {},
          h("th", {}, "Queue"), h("th", {}, "Reason"), h("th", {}, "Exception"),
          h("th", { class: "num" }, "Messages"), h("th", {}, "First parked"),
          h("th", {}, "Last parked"), h("th", {}, ""))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, status === "parked" && !q ? "Nothing is parked." : "No groups."),
    pager,
    rulesPanel(ctx, rules, queues),
  ];
}
