// The login page: a name and a secret (named operators), or the desk's token (the quick start);
// says why the last attempt was refused (/login?failed=...).

const MODES = {
  token: { label: "Token", help: "The value of RABBIT_RETRY_DESK_TOKEN where the desk runs.", name: false },
  operators: { label: "Secret", help: "Your name and secret, as the desk's access file lists them.", name: true },
};
const FAILED = {
  1: "That is not a name and secret (or token) of this desk. Try again.",
  name: "Give your name as well as your secret.",
};

function set(id, text) {
  document.getElementById(id).textContent = text;
}

async function setUp() {
  const params = new URLSearchParams(window.location.search);
  const failed = params.get("failed");
  const line = document.getElementById("login-failed");
  if (failed === "throttled") {
    line.textContent = `Too many failed logins from here: try again in ${params.get("wait") || "a few"} s.`;
  } else if (failed) {
    line.textContent = FAILED[failed] || FAILED[1];
  }
  line.hidden = !failed;
  let mode = "operators";
  try {
    const response = await fetch("/login/mode", { cache: "no-store" });
    if (response.ok) mode = (await response.json()).mode;
  } catch {
    // the form still works: both fields are sent
  }
  const shown = MODES[mode] || MODES.operators;
  set("secret-label", shown.label);
  set("secret-help", shown.help);
  const name = document.getElementById("name");
  document.getElementById("name-label").hidden = !shown.name;
  name.required = shown.name;
  (shown.name ? name : document.getElementById("secret")).focus();
}

setUp();
