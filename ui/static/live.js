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

/* Live updates on a run page: while the newest events are on screen, events recorded since are
   appended every few seconds (the same page, fetched again). Rows already shown, and the ones
   you opened, are left alone. */
(function () {
  var list = document.querySelector("#timeline .timeline");
  if (!list || document.querySelector('#timeline a[rel="next"]') || !window.fetch) return;
  function refresh() {
    if (document.hidden) return;
    fetch(location.href, {credentials: "same-origin"})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (!html) return;
        var fresh = new DOMParser().parseFromString(html, "text/html");
        fresh.querySelectorAll("#timeline .timeline details.event").forEach(function (row) {
          if (!document.getElementById(row.id)) list.appendChild(document.importNode(row, true));
        });
        var ranges = document.querySelectorAll("#timeline .pager .range");
        var newRanges = fresh.querySelectorAll("#timeline .pager .range");
        ranges.forEach(function (range, i) { if (newRanges[i]) range.textContent = newRanges[i].textContent; });
      })
      .catch(function () { /* offline for a moment: try again on the next tick */ });
  }
  setInterval(refresh, 3000);
})();
