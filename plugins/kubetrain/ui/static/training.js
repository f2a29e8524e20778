// kubetrain's Training page. Works without this file; it only makes two things nicer:
// 1. Links to Airflow's own pages (data-top) open in the Airflow UI around this page (an iframe of
//    the same origin that may not navigate its parent): the parent's router is told to go there.
// 2. "Compare selected" is enabled for 2 to 5 selected runs and says how many are selected.
(function () {
  "use strict";

  function openInAirflow(href) {
    var parent = window.parent;
    if (!parent || parent === window) return false;
    try {
      var target = new URL(href, window.location.href);
      if (target.origin !== parent.location.origin) return false;
      var state = parent.history.state || {};
      var idx = typeof state.idx === "number" ? state.idx + 1 : 0;
      parent.history.pushState({ usr: null, key: Math.random().toString(36).slice(2, 10), idx: idx }, "",
        target.pathname + target.search + target.hash);
      parent.dispatchEvent(new PopStateEvent("popstate", { state: parent.history.state }));
      return true;
    } catch (err) {
      return false;
    }
  }

  document.addEventListener("click", function (event) {
    var link = event.target.closest ? event.target.closest("a[data-top]") : null;
    if (!link || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;
    if (openInAirflow(link.getAttribute("href"))) event.preventDefault();
  });

  document.querySelectorAll("form.compare-form").forEach(function (form) {
    var button = form.querySelector(".compare-button");
    var hint = form.querySelector(".hint");
    function update() {
      var n = form.querySelectorAll("input[name=run]:checked").length;
      button.disabled = n < 2 || n > 5;
      if (hint) hint.textContent = n ? n + " selected (2 to 5)" : "select 2 to 5 runs";
    }
    form.addEventListener("change", update);
    update();
  });
})();
