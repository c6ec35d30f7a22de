// Relay's dashboard: what a page says when a request gets no answer at all.
//
// htmx swaps in whatever the server answers, its error pages included. A
// request that never reaches the server, or whose answer never arrives (a
// phone out of signal), ends in htmx:sendError or htmx:timeout, which htmx
// only logs: a Requeue pressed offline did nothing and said nothing, and a
// page whose refreshes failed went on showing old numbers as if they were
// current. Loaded from this server (the Content-Security-Policy allows no
// inline script); it changes text only, never markup from a response.
(function () {
  "use strict";

  var UNANSWERED_ACTION =
    "No answer from Relay (is the network down?). It may or may not have been done: " +
    "reload the page to see where things stand before you press again.";

  function banner() {
    return document.getElementById("no-answer");
  }

  function unanswered(event) {
    var detail = event.detail || {};
    var verb = detail.requestConfig ? detail.requestConfig.verb : "get";
    if (verb === "get") {
      var shown = banner();
      if (shown && shown.hidden) {
        shown.querySelector("[data-since]").textContent = new Date().toLocaleTimeString();
        shown.hidden = false;
      }
      return;
    }
    var form = event.target instanceof Element ? event.target.closest("form") : null;
    if (!form) {
      return;
    }
    // Before the buttons (a fieldset of them on a job's card), replacing an earlier such note.
    var place = form.closest("fieldset") || form;
    var before = place.previousElementSibling;
    if (before && before.classList.contains("no-answer")) {
      before.remove();
    }
    var note = document.createElement("p");
    note.className = "flash flash-error no-answer";
    note.setAttribute("role", "alert");
    note.setAttribute("tabindex", "-1");
    note.textContent = UNANSWERED_ACTION;
    place.parentNode.insertBefore(note, place);
    note.focus();
  }

  // A button disabled while its action is on its way (hx-disabled-elt, so that a second tap sends
  // nothing) loses the keyboard focus; htmx, which puts the focus back on the element of the same id
  // after a swap, then finds none to put back, and the focus fell to the top of the page (Pause pressed
  // from the keyboard). It goes back to the element of the pressed one's id as the action's answer is
  // swapped in (an answer's own autofocus, on its notice, takes it after that, as the swap settles).
  // Only an action's own swap does it, and the id is forgotten as that action ends, answered or not:
  // kept past an action that got no answer, it moved the focus in a later refresh.
  var pressedId = null;

  function isAction(event) {
    var config = event.detail ? event.detail.requestConfig : null;
    return Boolean(config && config.verb !== "get");
  }

  document.addEventListener("htmx:beforeRequest", function (event) {
    var active = document.activeElement;
    if (isAction(event) && active && active.id && event.target.contains(active)) {
      pressedId = active.id;
    }
  });
  document.addEventListener("htmx:afterSwap", function (event) {
    var active = document.activeElement;
    if (isAction(event) && pressedId && (!active || active === document.body)) {
      var again = document.getElementById(pressedId);
      if (again) {
        again.focus({ preventScroll: true });
      }
    }
  });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (isAction(event)) {
      pressedId = null;
    }
  });

  // An action's answer takes the focus once, as it comes (autofocus, which htmx honours in the content it
  // swaps in, before that content's htmx:load). The answer is then kept through the card's refreshes
  // (hx-preserve), and with it its autofocus: every refresh focused it again, and the page jumped back
  // to it every 2 s, so the errors and payload below it could not be read on a phone.
  document.addEventListener("htmx:load", function (event) {
    var loaded = event.detail ? event.detail.elt : null;
    if (!(loaded instanceof Element)) {
      return;
    }
    if (loaded.hasAttribute("autofocus")) {
      loaded.removeAttribute("autofocus");
    }
    loaded.querySelectorAll("[autofocus]").forEach(function (focused) {
      focused.removeAttribute("autofocus");
    });
  });

  document.addEventListener("htmx:sendError", unanswered);
  document.addEventListener("htmx:timeout", unanswered);
  document.addEventListener("htmx:afterRequest", function (event) {
    var xhr = event.detail ? event.detail.xhr : null;
    var shown = banner();
    if (xhr && xhr.status > 0 && shown) {
      shown.hidden = true; // answered again, whatever the answer: the page is current
    }
  });
})();
