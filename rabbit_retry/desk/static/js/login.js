// The login page: says so when the last token was refused (/login?failed=1).
const failed = new URLSearchParams(window.location.search).get("failed");
document.getElementById("login-failed").hidden = !failed;
