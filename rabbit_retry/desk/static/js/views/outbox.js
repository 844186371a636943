// Outbox: an application's events the relay could not publish (the broker returned or refused
// them), beside the parked messages: dead ones wait for an operator, failed ones are tried again
// on a schedule. Select some and retry them (pending again: the relay publishes them, the desk
// never does) or discard them, with a reason; one event shows its headers, body and history.

import { call, withQuery } from "../api.js";
import { outboxDiscard, outboxRetry, report } from "../dialogs.js";
import { asText, count, h, pairs, shorten, when } from "../dom.js";
import { filterForm } from "./filters.js";

const PAGE = 50;
const STATUSES = [["", "dead and failed"], ["dead", "dead"], ["failed", "failed"],
  ["discarded", "discarded"]];

function destination(e) {
  return e.exchange
    ? [h("code", {}, e.exchange), " ", h("span", { class: "muted" }, "key "), h("code", {}, e.routing_key)]
    : [h("span", { class: "muted" }, "queue "), h("code", {}, e.routing_key)];
}

async function act(ctx, kind, events) {
  const result = kind === "retry" ? await outboxRetry(events) : await outboxDiscard(events);
  if (!result) return false;
  report(ctx, result);
  ctx.rerender();
  return true;
}

async function renderEvent(ctx) {
  const e = await call(`/api/outbox/${encodeURIComponent(ctx.arg)}`);
  const mayAct = ctx.me().may_act && (e.status === "dead" || e.status === "failed");
  const body = typeof e.body === "string" ? e.body : e.body_base64 || "";
  const history = (e.history || []).map((entry) => h("tr", {},
    h("td", { class: "time" }, when(entry.at)),
    h("td", {}, h("span", { class: `status status-${String(entry.status).replace(/[^a-z-]/g, "")}` }, entry.status)),
    h("td", { class: "num" }, entry.attempt ?? ""),
    h("td", {}, entry.actor || ""),
    h("td", { class: "why" }, entry.detail || "")));
  const retry = h("button", { type: "button", id: "outbox-retry-one", class: "primary" }, "Retry…");
  const discard = h("button", { type: "button", id: "outbox-discard-one", class: "danger" }, "Discard…");
  retry.addEventListener("click", () => act(ctx, "retry", [e]).catch(ctx.fail));
  discard.addEventListener("click", () => act(ctx, "discard", [e]).catch(ctx.fail));
  return [
    h("p", {}, h("a", { href: ctx.link("outbox") }, "← outbox")),
    h("h2", {}, "Outbox event ", h("code", {}, `#${e.id}`), " ",
      h("span", { class: `status status-${String(e.status).replace(/[^a-z-]/g, "")}` }, e.status)),
    mayAct ? h("div", { class: "toolbar" }, retry, discard) : null,
    pairs([["message id", e.message_id], ["destination", e.destination], ["exchange", e.exchange],
      ["routing key", e.routing_key], ["order key", e.key ?? "—"], ["attempts", e.attempts],
      ["last error", e.error ?? "—"], ["added", e.created_at], ["changed", e.changed_at ?? "—"],
      ["next try", e.due_at ?? "—"]], ""),
    h("h3", {}, "Headers"),
    pairs(Object.entries(e.headers || {}), "No headers."),
    h("h3", {}, "Properties"),
    pairs(Object.entries(e.properties || {}), "No properties."),
    h("h3", {}, typeof e.body === "string" ? "Body" : "Body (base64)"),
    h("pre", { class: "body", id: "outbox-body" }, body),
    h("h3", {}, "History"),
    h("table", { class: "grid", id: "outbox-history" },
      h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Status"),
        h("th", { class: "num" }, "Attempt"), h("th", {}, "Who"), h("th", {}, "Detail"))),
      h("tbody", {}, history)),
  ];
}

export async function renderOutbox(ctx) {
  if (ctx.arg) return renderEvent(ctx);
  const p = ctx.params;
  const status = STATUSES.some(([v]) => v === (p.get("status") || "")) ? p.get("status") || "" : "";
  const q = p.get("q") || "";
  let offset = Number.parseInt(p.get("offset") || "", 10);
  if (!Number.isFinite(offset) || offset < 0) offset = 0;
  const page = await call(withQuery("/api/outbox", { status, q, limit: PAGE, offset }));
  const items = page.items || [];
  const total = page.total || 0;
  const here = (over = {}) => ctx.link("outbox", { status, q, offset: offset || "", ...over });

  const search = h("input", { type: "search", name: "q", id: "outbox-q", value: q, size: "30",
    placeholder: "message id or order key" });
  const statusSelect = h("select", { name: "status", id: "outbox-status" },
    STATUSES.map(([value, label]) => h("option", { value, selected: value === status }, label)));
  const form = filterForm("outbox-filter", [
    h("label", { class: "grow" }, "Search ", search),
    h("label", {}, "Status ", statusSelect),
    h("button", { type: "submit", class: "primary" }, "Search"),
  ], () => ctx.go(here({ q: search.value.trim(), status: statusSelect.value, offset: "" })));
  statusSelect.addEventListener("change", () => form.requestSubmit());

  const mayAct = ctx.me().may_act;
  const actionable = (e) => mayAct && (e.status === "dead" || e.status === "failed");
  const selected = new Map();
  const selectedCount = h("span", { id: "outbox-selected-count" });
  const retryButton = h("button", { type: "button", id: "outbox-retry-selected" }, "Retry selected…");
  const discardButton = h("button", { type: "button", id: "outbox-discard-selected", class: "danger" },
    "Discard selected…");
  function refresh() {
    selectedCount.textContent = selected.size ? `${count(selected.size)} selected` : "none selected";
    retryButton.disabled = discardButton.disabled = selected.size === 0;
  }
  retryButton.addEventListener("click", () => act(ctx, "retry", [...selected.values()]).catch(ctx.fail));
  discardButton.addEventListener("click", () => act(ctx, "discard", [...selected.values()]).catch(ctx.fail));

  const rows = items.map((e) => {
    let box = null;
    if (actionable(e)) {
      box = h("input", { type: "checkbox", class: "select", "aria-label": `select ${e.message_id}` });
      box.addEventListener("change", () => {
        if (box.checked) selected.set(String(e.id), e);
        else selected.delete(String(e.id));
        refresh();
      });
    }
    return h("tr", { dataset: { id: String(e.id), status: e.status } },
      h("td", { class: "check" }, box),
      h("td", { class: "ids" }, h("a", { href: `#/outbox/${encodeURIComponent(e.id)}`, class: "open" },
        e.message_id || `#${e.id}`)),
      h("td", { class: "queue" }, destination(e)),
      h("td", {}, e.key ? h("code", {}, e.key) : h("span", { class: "muted" }, "—")),
      h("td", {}, h("span", { class: `status status-${String(e.status).replace(/[^a-z-]/g, "")}` }, e.status)),
      h("td", { class: "num" }, e.attempts ?? "—"),
      h("td", { class: "exception", title: asText(e.error || "") }, shorten(e.error, 200)),
      h("td", { class: "time" }, when(e.created_at)),
      h("td", { class: "time" }, e.status === "failed" ? ["next try ", when(e.due_at)] : when(e.changed_at)));
  });
  const pager = h("nav", { class: "pager", "aria-label": "pages" },
    h("span", { id: "outbox-range" }, total
      ? `${count(offset + 1)}–${count(Math.min(offset + items.length, total))} of ${count(total)}` : "0 of 0"),
    offset > 0 ? h("a", { href: here({ offset: Math.max(0, offset - PAGE) || "" }), rel: "prev" }, "‹ previous") : null,
    offset + items.length < total ? h("a", { href: here({ offset: offset + PAGE }), rel: "next" }, "next ›") : null);
  refresh();
  return [
    h("h2", {}, "Outbox"),
    h("p", { class: "muted" }, "Events of ", h("code", {}, page.outbox || "the outbox"),
      " the broker returned or refused. A failed event is tried again on a schedule; a dead one waits "
      + "for you. Retried, an event is pending again and the relay publishes it."),
    form,
    mayAct && items.some(actionable) ? h("div", { class: "toolbar" }, selectedCount, retryButton, discardButton) : null,
    items.length
      ? h("table", { class: "grid", id: "outbox" },
        h("thead", {}, h("tr", {}, h("th", { class: "check" }, ""), h("th", {}, "Message id"),
          h("th", {}, "Destination"), h("th", {}, "Order key"), h("th", {}, "Status"),
          h("th", { class: "num" }, "Attempts"), h("th", {}, "Last error"), h("th", {}, "Added"),
          h("th", {}, "Changed"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, q ? "No event matches." : "No events here."),
    pager,
  ];
}
