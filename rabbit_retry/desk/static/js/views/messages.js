// Messages: search and page through stored messages (one page at a time from the API, never
// all of them), select some and replay or discard them (parked), or restore them (discarded).

import { call, withQuery } from "../api.js";
import { discard, replay, report, restore } from "../dialogs.js";
import { count, h, shorten, when } from "../dom.js";
import { filterForm, queueOptions, statusOptions, statusParam } from "./filters.js";

const PAGE_SIZES = [25, 50, 100, 200];
const DEFAULT_LIMIT = 50;

// The selection outlives paging, not a change of filter: {key, byId: Map(String(id) -> item)}.
let selection = { key: "", byId: new Map() };

function pageParams(params) {
  let limit = Number.parseInt(params.get("limit") || "", 10);
  if (!PAGE_SIZES.includes(limit)) limit = DEFAULT_LIMIT;
  let offset = Number.parseInt(params.get("offset") || "", 10);
  if (!Number.isFinite(offset) || offset < 0) offset = 0;
  return { limit, offset: offset - (offset % limit) };
}

export async function renderMessages(ctx) {
  const p = ctx.params;
  const filters = {
    queue: p.get("queue") || "",
    group: p.get("group") || "",
    status: statusParam(p),
    q: p.get("q") || "",
  };
  const { limit, offset } = pageParams(p);
  const [page, queues] = await Promise.all([
    call(withQuery("/api/messages", { ...filters, limit, offset })),
    ctx.queues(),
  ]);
  const items = page.items || [];
  const total = page.total || 0;

  const key = JSON.stringify(filters);
  if (selection.key !== key) selection = { key, byId: new Map() };
  const selected = selection.byId;

  // Where the filters and paging lead; `over` replaces some of them.
  const here = (over = {}) => ctx.link("messages", {
    q: filters.q, queue: filters.queue, group: filters.group, status: p.get("status"),
    limit: limit === DEFAULT_LIMIT ? "" : limit, offset: offset || "", ...over,
  });

  const search = h("input", { type: "search", name: "q", id: "messages-q", value: filters.q,
    placeholder: "message id, correlation id, text in the body, or header=value", size: "40",
    title: "A message id or correlation id (exact), text in the body or the exception message, "
      + "or NAME=VALUE for a header (tenant=acme)" });
  const queueSelect = h("select", { name: "queue", id: "messages-queue" },
    queueOptions(queues, filters.queue));
  const statusSelect = h("select", { name: "status", id: "messages-status" }, statusOptions(p));
  const form = filterForm("messages-filter", [
    h("label", { class: "grow" }, "Search ", search),
    h("label", {}, "Queue ", queueSelect),
    h("label", {}, "Status ", statusSelect),
    h("button", { type: "submit", class: "primary" }, "Search"),
  ], () => ctx.go(here({ q: search.value.trim(), queue: queueSelect.value,
    status: statusSelect.value, offset: "" })));
  for (const select of [queueSelect, statusSelect]) {
    select.addEventListener("change", () => form.requestSubmit());
  }

  const groupNote = filters.group
    ? h("p", { class: "scope", id: "messages-group" }, "Only the group ",
      h("code", { title: filters.group }, shorten(filters.group, 16)),
      items[0] ? [": ", h("b", {}, items[0].exception_type || ""), " ",
        shorten(items[0].exception_message, 120)] : null,
      " ", h("a", { href: here({ group: "", offset: "" }) }, "show every group"))
    : null;

  // Selection: parked messages can be replayed or discarded, discarded ones restored; a viewer
  // selects nothing.
  const mayAct = ctx.me().may_act;
  const restoring = filters.status === "discarded";
  const actionable = (m) => mayAct && m.status === (restoring ? "discarded" : "parked");
  const selectable = items.filter(actionable);
  const selectedCount = h("span", { id: "selected-count" });
  const replayButton = h("button", { type: "button", id: "replay-selected", hidden: restoring },
    "Replay selected…");
  const discardButton = h("button", { type: "button", id: "discard-selected", class: "danger",
    hidden: restoring }, "Discard selected…");
  const restoreButton = h("button", { type: "button", id: "restore-selected", hidden: !restoring },
    "Restore selected…");
  const clearButton = h("button", { type: "button", id: "clear-selection", class: "link" },
    "clear selection");
  const all = h("input", { type: "checkbox", id: "select-page", "aria-label": "select this page",
    disabled: selectable.length === 0 });
  const boxes = new Map();

  function refreshSelection() {
    const n = selected.size;
    selectedCount.textContent = n ? `${count(n)} selected` : "none selected";
    replayButton.disabled = discardButton.disabled = restoreButton.disabled = n === 0;
    clearButton.hidden = n === 0;
    const onPage = selectable.filter((m) => selected.has(String(m.id))).length;
    all.checked = selectable.length > 0 && onPage === selectable.length;
    all.indeterminate = onPage > 0 && onPage < selectable.length;
    for (const [id, box] of boxes) box.checked = selected.has(id);
  }

  all.addEventListener("change", () => {
    for (const m of selectable) {
      if (all.checked) selected.set(String(m.id), m);
      else selected.delete(String(m.id));
    }
    refreshSelection();
  });
  clearButton.addEventListener("click", () => {
    selected.clear();
    refreshSelection();
  });

  async function act(kind) {
    const messages = [...selected.values()];
    const result = kind === "replay" ? await replay({ messages }, queues)
      : kind === "restore" ? await restore({ messages }) : await discard({ messages });
    if (!result) return;
    selected.clear();
    report(ctx, result);
    ctx.rerender();
  }
  replayButton.addEventListener("click", () => act("replay").catch(ctx.fail));
  discardButton.addEventListener("click", () => act("discard").catch(ctx.fail));
  restoreButton.addEventListener("click", () => act("restore").catch(ctx.fail));

  const rows = items.map((m) => {
    const id = String(m.id);
    let box = null;
    if (actionable(m)) {
      box = h("input", { type: "checkbox", class: "select", "aria-label": `select ${m.message_id || id}` });
      box.addEventListener("change", () => {
        if (box.checked) selected.set(id, m);
        else selected.delete(id);
        refreshSelection();
      });
      boxes.set(id, box);
    }
    return h("tr", { dataset: { id } },
      h("td", { class: "check" }, box),
      h("td", { class: "ids" }, h("a", { href: `#/message/${encodeURIComponent(id)}`, class: "open" },
        m.message_id || `#${id}`),
      m.message_id_generated ? h("span", { class: "chip generated", title: "made up by rabbit-retry: the publisher set no message_id" }, "generated") : null,
      m.message_id === null ? h("span", { class: "chip generated", title: "the publisher set no message_id" }, "no message id") : null,
      m.edited ? h("span", { class: "chip edited", title: "an operator edited this copy before replaying it" }, "edited") : null,
      m.holds_key != null ? h("span", { class: "chip holds-key", title: "holds its ordered key: the key's later messages wait until this one is replayed or discarded" }, "holds key ", h("code", {}, m.holds_key)) : null,
      m.correlation_id ? h("div", { class: "correlation muted", title: "correlation id" }, "corr. ", m.correlation_id) : null),
      h("td", { class: "queue" }, m.queue),
      h("td", {}, h("span", { class: `status status-${m.status}` }, m.status)),
      h("td", {}, m.reason),
      h("td", { class: "exception" },
        h("div", { class: "type" }, m.exception_type || ""),
        h("div", { class: "message" }, shorten(m.exception_message, 160))),
      h("td", { class: "num" }, m.attempts ?? "—"),
      h("td", { class: "time" }, when(m.parked_at)));
  });

  const first = total === 0 ? 0 : offset + 1;
  const last = Math.min(offset + items.length, total);
  const size = h("select", { id: "page-size", "aria-label": "messages a page" },
    PAGE_SIZES.map((n) => h("option", { value: String(n), selected: n === limit }, `${n} a page`)));
  size.addEventListener("change", () => ctx.go(here({ limit: size.value, offset: "" })));
  const pager = h("nav", { class: "pager", "aria-label": "pages" },
    h("span", { id: "page-range" }, total ? `${count(first)}–${count(last)} of ${count(total)}` : "0 of 0"),
    offset > 0 ? h("a", { href: here({ offset: "" }), id: "page-first" }, "« first") : null,
    offset > 0
      ? h("a", { href: here({ offset: Math.max(0, offset - limit) || "" }), id: "page-prev", rel: "prev" }, "‹ previous")
      : null,
    offset + items.length < total
      ? h("a", { href: here({ offset: offset + limit }), id: "page-next", rel: "next" }, "next ›")
      : null,
    size);

  const view = [
    h("h2", {}, "Messages"),
    form,
    groupNote,
    mayAct ? h("div", { class: "toolbar" }, all, selectedCount, clearButton, replayButton, discardButton,
      restoreButton) : null,
    items.length
      ? h("table", { class: "grid", id: "messages" },
        h("thead", {}, h("tr", {}, h("th", { class: "check" }, ""), h("th", {}, "Message id"),
          h("th", {}, "Queue"), h("th", {}, "Status"), h("th", {}, "Reason"),
          h("th", {}, "Exception"), h("th", { class: "num" }, "Attempts"), h("th", {}, "Parked at"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, filters.q ? "No message matches." : "No messages."),
    pager,
  ];
  refreshSelection();
  return view;
}
