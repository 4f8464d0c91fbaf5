// Marks table cells that hold a number (they start with a digit, a sign or a bracket followed by one,
// e.g. "0.95 [0.90, 1.01] t", "48/48", "-0.02", "12.6x") so numbers.css keeps each on one line.
// Prose cells still wrap. Runs on every page load, including Material's instant navigation.
(function () {
  var NUMBER = /^\s*[\[(]?[-+\u2212~]?\.?\d/;
  function mark() {
    document.querySelectorAll(".md-typeset table td").forEach(function (td) {
      if (NUMBER.test(td.textContent) && td.textContent.length <= 60) td.classList.add("kvn-num");
    });
  }
  if (typeof document$ !== "undefined") { document$.subscribe(mark); } else { document.addEventListener("DOMContentLoaded", mark); }
})();
