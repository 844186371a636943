// The filter forms the groups and messages views share.

import { h } from "../dom.js";

const STATUSES = [
  ["parked", "parked"],
  ["replaying", "replaying"],
  ["replayed", "replayed"],
  ["discarded", "discarded"],
  ["any", "any status"],
];

// The status to ask the API for: parked when the address names none, nothing for "any".
export function statusParam(params) {
  const status = params.get("status") || "parked";
  return status === "any" ? "" : status;
}

// The status choices; groups are always of one status (`any: false`), messages may be of any.
export function statusOptions(params, { any = true } = {}) {
  const chosen = params.get("status") || "parked";
  return STATUSES.filter(([value]) => any || value !== "any").map(([value, label]) =>
    h("option", { value: value === "parked" ? "" : value, selected: value === chosen }, label));
}

export function queueOptions(queues, chosen) {
  return [
    h("option", { value: "" }, "every queue"),
    queues.map((q) => h("option", { value: q.queue, selected: q.queue === chosen }, q.queue)),
  ];
}

// A form that calls `submit` instead of navigating.
export function filterForm(id, fields, submit) {
  const form = h("form", { class: "filters", id, role: "search" }, fields);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  return form;
}
