/* Progressive enhancement only: every page works without this file.
   "Fork after step k" links (in the timeline and in a failure banner) pick step k in the fork form
   here instead of reloading the page with ?fork_step=k. */
document.addEventListener("click", function (e) {
  var link = e.target.closest && e.target.closest("a[data-fork-step]");
  if (!link) return;
  var field = document.getElementById("fork-step");
  if (!field) return;
  e.preventDefault();
  field.value = link.getAttribute("data-fork-step");
  field.dispatchEvent(new Event("change", {bubbles: true}));   // the form's plan follows the step
  var form = document.getElementById("fork");
  if (form) form.scrollIntoView({block: "start"});
  if (history.replaceState) history.replaceState(null, "", "#fork");
  var name = document.getElementById("fork-name");
  if (name) setTimeout(function () { name.focus(); }, 0);
});

/* Copy buttons on state snapshots and code: a JSON tree's text is the JSON itself. */
(function () {
  function copyText(text, button) {
    function done() {
      button.textContent = "Copied";
      setTimeout(function () { button.textContent = "Copy"; }, 1500);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallback(text); done(); });
    } else {
      fallback(text);
      done();
    }
  }
  function fallback(text) {
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "sr-only";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (err) { /* nothing more to try */ }
    document.body.removeChild(area);
  }
  function addButtons(root) {
    root.querySelectorAll(".copyable, #continue-snippet").forEach(function (box) {
      var snippet = box.id === "continue-snippet";
      var holder = snippet ? box.parentNode : box;
      if (holder.querySelector(":scope > .copy-btn")) return;
      var button = document.createElement("button");
      button.type = "button";
      button.className = "btn-quiet copy-btn" + (snippet ? " static" : "");
      button.textContent = "Copy";
      button.addEventListener("click", function (e) {
        e.preventDefault();
        var source = box.id === "continue-snippet" ? box : box.querySelector(".jtree, pre");
        if (source) copyText(source.textContent, button);
      });
      holder.insertBefore(button, snippet ? box : holder.firstChild);
    });
  }
  addButtons(document);
  window.actaeAddCopyButtons = addButtons;
})();

/* Live updates on a run page: while the newest events are on screen, events recorded since are
   appended every few seconds (the same page, fetched again), and the header figures, status,
   failure banner and step picture (marked data-live) are replaced. Rows already shown, and the
   ones you opened, are left alone. */
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
          if (!document.getElementById(row.id)) {
            var added = document.importNode(row, true);
            list.appendChild(added);
            if (window.actaeAddCopyButtons) window.actaeAddCopyButtons(added);
          }
        });
        document.querySelectorAll("[data-live]").forEach(function (part) {
          var newer = fresh.getElementById(part.id);
          if (newer && newer.innerHTML !== part.innerHTML) part.replaceWith(document.importNode(newer, true));
        });
        var ranges = document.querySelectorAll("#timeline .pager .range");
        var newRanges = fresh.querySelectorAll("#timeline .pager .range");
        ranges.forEach(function (range, i) { if (newRanges[i]) range.textContent = newRanges[i].textContent; });
      })
      .catch(function () { /* offline for a moment: try again on the next tick */ });
  }
  setInterval(refresh, 3000);
})();

/* The fork form's plan: what the fork would do with the source's effects, for the step and tool
   policies chosen, fetched as they change (without this file, "Plan it first" shows the same page). */
(function () {
  var form = document.querySelector("form.fork-form[data-plan-url]");
  var panel = document.getElementById("fork-plan");
  if (!form || !panel || !window.fetch) return;
  var timer = null, asked = 0;
  function load() {
    var query = new URLSearchParams({fragment: "1"});
    ["step", "tool_policies", "intervention"].forEach(function (name) {
      var field = form.elements[name];
      if (field && field.value) query.set(name, field.value);
    });
    var mine = ++asked;
    fetch(form.getAttribute("data-plan-url") + "?" + query.toString(), {credentials: "same-origin"})
      .then(function (answer) { return answer.ok ? answer.text() : ""; })
      .then(function (html) {
        if (mine !== asked) return;                     // a newer choice is on its way
        panel.innerHTML = html;
        panel.setAttribute("data-step", query.get("step") || "");
        var link = document.getElementById("plan-link");     // the plan's own page, for these choices
        if (link) {
          query.delete("fragment");
          if (form.elements.name && form.elements.name.value) query.set("name", form.elements.name.value);
          if (form.elements.hand_off && form.elements.hand_off.checked) query.set("hand_off", "1");
          link.href = form.getAttribute("data-plan-url") + "?" + query.toString();
        }
      })
      .catch(function () {});
  }
  function soon(ms) { clearTimeout(timer); timer = setTimeout(load, ms); }
  form.addEventListener("change", function () { soon(100); });
  form.addEventListener("input", function (e) { if (e.target.tagName === "TEXTAREA") soon(500); });
  load();
})();

/* A fork handed to a worker: its card (marked data-poll) is fetched again every second and put in
   place, until the job is over (done or failed: the card then carries no data-poll). */
(function () {
  if (!window.fetch) return;
  function poll() {
    var card = document.querySelector("#hand-off[data-poll]");
    if (!card) return;
    if (document.hidden) { setTimeout(poll, 1000); return; }
    fetch(card.getAttribute("data-poll"), {credentials: "same-origin"})
      .then(function (answer) { return answer.ok ? answer.text() : null; })
      .then(function (html) {
        if (html) {
          var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("hand-off");
          var now = document.getElementById("hand-off");
          if (fresh && now && fresh.outerHTML !== now.outerHTML) now.replaceWith(document.importNode(fresh, true));
        }
        setTimeout(poll, 1000);
      })
      .catch(function () { setTimeout(poll, 2000); });
  }
  setTimeout(poll, 1000);
})();
