// One group: its cause, how many of its messages are in each status, what can be done with
// them, and the notes operators wrote about it (who, when).

import { call } from "../api.js";
import { discard, replay, report, restore } from "../dialogs.js";
import { count, h, when } from "../dom.js";

const STATUSES = ["parked", "replayed", "discarded"];

export async function renderGroup(ctx) {
  const id = ctx.arg;
  const [g, queues] = await Promise.all([call(`/api/groups/${encodeURIComponent(id)}`), ctx.queues()]);
  const counts = g.counts || {};
  const mayAct = ctx.me().may_act;
  const summary = { id: g.id, queue: g.queue, exception_type: g.exception_type,
    exception_message: g.exception_message };

  async function act(kind) {
    const group = { ...summary, count: counts[kind === "restore" ? "discarded" : "parked"] || 0 };
    const result = kind === "replay" ? await replay({ group }, queues)
      : kind === "restore" ? await restore({ group }) : await discard({ group });
    if (!result) return;
    report(ctx, result);
    ctx.rerender();
  }

  const text = h("textarea", { id: "note-text", name: "text", rows: "3", maxlength: "1000",
    required: true, placeholder: "what you found, who you asked, what to do next" });
  const form = h("form", { id: "note-form" }, h("label", {}, "Add a note ", text),
    h("div", { class: "buttons" }, h("button", { type: "submit", class: "primary" }, "Add note")));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!text.value.trim()) {
      ctx.fail(new Error("an empty note"));
      return;
    }
    try {
      await call(`/api/groups/${encodeURIComponent(id)}/notes`, { text: text.value.trim() });
      ctx.notify("Note added.");
      ctx.rerender();
    } catch (error) {
      ctx.fail(error);
    }
  });

  const notes = (g.notes || []).map((n) => h("li", { class: "note" },
    h("div", { class: "meta" }, h("b", {}, n.actor), " · ", when(n.at)),
    h("p", { class: "text" }, n.text)));

  return [
    h("p", {}, h("a", { href: "#/groups", class: "back" }, "← groups")),
    h("h2", {}, "Group ", h("code", { id: "group-id" }, g.id)),
    h("dl", { class: "summary" },
      h("dt", {}, "Queue"), h("dd", {}, g.queue),
      h("dt", {}, "Reason"), h("dd", {}, g.reason || "—"),
      h("dt", {}, "Exception"), h("dd", { class: "exception" }, h("b", {}, g.exception_type || "(none)"),
        " ", h("span", { class: "message" }, g.exception_message || "")),
      g.sample && g.sample !== g.exception_message ? [h("dt", {}, "For example"), h("dd", {}, g.sample)] : null,
      h("dt", {}, "Messages"), h("dd", { id: "group-counts" }, STATUSES.map((s) =>
        h("a", { href: ctx.link("messages", { group: g.id, status: s }), class: `chip status-${s}` },
          `${s} ${count(counts[s] || 0)}`)))),
    mayAct
      ? h("div", { class: "toolbar" },
        counts.parked ? h("button", { type: "button", id: "replay-group", onclick: () => act("replay").catch(ctx.fail) }, "Replay…") : null,
        counts.parked ? h("button", { type: "button", id: "discard-group", class: "danger", onclick: () => act("discard").catch(ctx.fail) }, "Discard…") : null,
        counts.discarded ? h("button", { type: "button", id: "restore-group", onclick: () => act("restore").catch(ctx.fail) }, "Restore…") : null)
      : null,
    h("h3", {}, `Notes (${notes.length})`),
    notes.length ? h("ul", { class: "notes", id: "notes" }, notes)
      : h("p", { class: "muted", id: "notes" }, "No notes yet."),
    mayAct ? form : null,
  ];
}
