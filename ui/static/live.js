/* Progressive enhancement only: every page works without this file.
   "Fork from step k" links in the timeline also pick step k in the fork form. */
document.addEventListener("click", function (e) {
  var link = e.target.closest && e.target.closest("a[data-fork-step]");
  if (!link) return;
  var field = document.getElementById("fork-step");
  if (field) field.value = link.getAttribute("data-fork-step");
  var name = document.querySelector(".fork-form input[name=name]");
  if (name && !name.value) setTimeout(function () { name.focus(); }, 0);
});
