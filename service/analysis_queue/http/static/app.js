// The dashboard: sign in with a pasted token, submit analyses, watch them live, cancel them
// (they stay listed, cancelled), remove finished ones, read each source's verdict and start
// delta re-checks. The list changes only on events from GET /v1/events (an EventSource, which
// reconnects by itself with Last-Event-ID); credits are re-read after events. A job's sources
// and verdicts are fetched once, when it is opened. Nothing polls; nothing about jobs is stored.
"use strict";

(() => {
  const TOKEN_KEY = "analysis-queue.token";
  const WAITING = {
    your_previous_analysis: "waits for your previous analysis",
    provider_capacity: "waits for provider capacity",
  };
  const UPSERT_KINDS = [
    "admitted", "promoted", "started", "finished", "cancelled", "changed", "waiting",
  ];
  const OPEN = new Set(["queued", "pending", "running"]);
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  // A mark of its own shape for each verdict, so that none is told apart by colour alone.
  const VERDICTS = {
    supported: { label: "supported", mark: "✓" },
    partially_supported: { label: "partially supported", mark: "◐" },
    unsupported: { label: "unsupported", mark: "✗" },
    not_found: { label: "not found", mark: "?" },
  };
  const FAILURES = {
    analysis_failed: "The analysis engine could not finish it.",
    release_timeout: "The analysis engine did not start it in time.",
    core_run_gone: "The analysis engine no longer had it.",
    core_run_lost: "The analysis engine lost it while it ran.",
  };
  const CANCELLED_BY = {
    cancelled_by_user: "by you",
    cancelled_in_core: "by the analysis engine",
  };
  const SUBMIT_FIELDS = { "thesis.title": "title", "thesis.document_url": "document-url", sources: "sources" };
  const REOPEN_DELAY_MS = 3000;
  const OLDER_PAGE = 50;
  const MAX_ANNOUNCED = 20;

  const state = {
    token: null,
    user: null,
    jobs: new Map(),
    views: new Map(),
    whole: new Map(), // job id -> {status, promise}: the job with its sources and verdicts
    next: null, // the cursor of the jobs older than those shown
    balance: null,
    source: null,
    renderPending: false,
    creditsTimer: null,
    reopenTimer: null,
    announcements: [],
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function button(text, className) {
    const node = el("button", className, text);
    node.type = "button";
    return node;
  }

  function plural(count, one, many) {
    return count + " " + (count === 1 ? one : many);
  }

  function quoted(text) {
    return "“" + text + "”";
  }

  function sentence(text) {
    const value = String(text || "").trim();
    if (!value) return "";
    const first = value.charAt(0).toUpperCase() + value.slice(1);
    return /[.!?]$/.test(first) ? first : first + ".";
  }

  function shortened(text, max) {
    return text.length > max ? text.slice(0, max - 1) + "…" : text;
  }

  // The token's payload, for showing who is signed in; the service checks the token, not this.
  function tokenSubject(token) {
    try {
      const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
      const bytes = Uint8Array.from(atob(part.padEnd(Math.ceil(part.length / 4) * 4, "=")), (c) =>
        c.charCodeAt(0),
      );
      const payload = JSON.parse(new TextDecoder().decode(bytes));
      return typeof payload.sub === "string" && payload.sub ? payload.sub : null;
    } catch (_ignored) {
      return null;
    }
  }

  // -- HTTP -------------------------------------------------------------------------------

  class HttpError extends Error {
    constructor(status, problem, retryAfter) {
      super((problem && problem.detail) || "HTTP " + status);
      this.status = status;
      this.problem = problem && typeof problem === "object" ? problem : {};
      this.retryAfter = retryAfter;
    }
  }

  async function api(method, path, body, headers) {
    const init = { method, headers: { Authorization: "Bearer " + state.token, ...(headers || {}) } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (_unreachable) {
      throw new HttpError(0, null, null);
    }
    let data = null;
    try {
      data = await response.json();
    } catch (_ignored) {
      data = null;
    }
    if (!response.ok) throw new HttpError(response.status, data, response.headers.get("Retry-After"));
    return data;
  }

  function retryText(retryAfter) {
    const seconds = Number.parseInt(retryAfter || "", 10);
    if (!Number.isFinite(seconds) || seconds <= 0) return " Try again shortly.";
    return " Try again in " + plural(seconds, "second", "seconds") + ".";
  }

  function kilobytes(bytes) {
    return Math.ceil(bytes / 1024) + " KB";
  }

  // What went wrong, in the lecturer's words; the field-level part of a 422 is fieldProblems'.
  function problemMessage(error) {
    const problem = error.problem || {};
    if (error.status === 0) return "The service cannot be reached. Check the connection and try again.";
    switch (problem.code) {
      case "insufficient_credits":
        return (
          "Not enough credits to start this analysis" +
          (state.balance === null ? "" : " (" + plural(state.balance, "credit", "credits") + " left)") +
          ". Ask for more credits, then try again."
        );
      case "provider_budget_exhausted":
        return "The analysis provider's budget is used up for now. Try again later.";
      case "core_unavailable":
        return "The analysis engine cannot be reached right now." + retryText(error.retryAfter);
      case "database_unavailable":
      case "too_many_connections":
        return "The service is busy right now." + retryText(error.retryAfter);
      case "shutting_down":
        return "The service is restarting." + retryText(error.retryAfter);
      case "job_too_large":
        return (
          "This is too much for one analysis: " + kilobytes(problem.size_bytes) + " of at most " +
          kilobytes(problem.limit_bytes) + ". Split the sources over two analyses."
        );
      case "payload_too_large":
        return "This is too much to send at once. Split the sources over two analyses.";
      case "not_found":
        return "This analysis no longer exists.";
      case "invalid_source":
        return "The analysis engine refused a source: " + sentence(problem.detail);
      case "unparseable_thesis":
        return "The analysis engine could not read this document: " + sentence(problem.detail);
      default:
        break;
    }
    const text = sentence(problem.detail || problem.title) || "The request failed (HTTP " + error.status + ").";
    return error.status === 503 || error.status === 429 ? text + retryText(error.retryAfter) : text;
  }

  // One 422 item in words: `what` is how the field is named to the lecturer.
  function fieldMessage(what, message) {
    const text = String(message || "");
    const most = /at most (\d+)/.exec(text);
    if (/at least 1 character/.test(text)) return what.empty;
    if (/at least 1 item/.test(text)) return "Add at least one source: a DOI or a URL, one per line.";
    if (/DOI/.test(text)) return what.subject + " is neither a DOI (10.NNNN/…) nor a web address starting with http:// or https://.";
    if (/http\(s\) URL/.test(text)) return what.subject + " is not a web address starting with http:// or https://.";
    if (/control characters/.test(text)) return what.subject + " contains a character that cannot be stored, such as a tab.";
    if (most && /item/.test(text)) return "At most " + most[1] + " sources fit in one analysis.";
    if (most) return what.subject + " is too long: at most " + Number(most[1]).toLocaleString() + " characters.";
    return what.subject + ": " + sentence(text);
  }

  const FIELD_WORDS = {
    title: { subject: "The title", empty: "Give the thesis a title." },
    "document-url": { subject: "The document URL", empty: "Give the web address of the thesis document." },
    sources: { subject: "The source list", empty: "Add at least one source: a DOI or a URL, one per line." },
  };

  // A problem's messages by the input they concern: `fields` maps the body's field names to input
  // ids (a source's line: `sources.N`, the Nth line sent); the rest is general.
  function fieldProblems(error, fields, lines) {
    const byInput = new Map();
    const general = [];
    const add = (input, text) => {
      if (!byInput.has(input)) byInput.set(input, []);
      byInput.get(input).push(text);
    };
    const problem = error.problem || {};
    if (problem.code === "invalid_body" && Array.isArray(problem.errors) && problem.errors.length) {
      for (const item of problem.errors) {
        const field = String(item.field || "");
        const line = /^sources\.(\d+)$/.exec(field);
        if (line && fields.sources) {
          const sent = lines[Number(line[1])];
          const subject = sent
            ? "Line " + sent.number + " (" + quoted(shortened(sent.text, 60)) + ")"
            : "A source";
          add(fields.sources, fieldMessage({ subject, empty: subject + " is empty." }, item.message));
        } else if (fields[field]) {
          add(fields[field], fieldMessage(FIELD_WORDS[fields[field]] || FIELD_WORDS.sources, item.message));
        } else {
          general.push(sentence(item.message));
        }
      }
      return { byInput, general };
    }
    const message = problemMessage(error);
    if (["job_too_large", "invalid_source"].includes(problem.code) && fields.sources) add(fields.sources, message);
    else if (problem.code === "unparseable_thesis" && fields["thesis.document_url"]) {
      add(fields["thesis.document_url"], message);
    } else general.push(message);
    return { byInput, general };
  }

  function showFieldError(inputId, messages) {
    const input = $(inputId);
    const note = $(inputId + "-error") || input.parentElement.querySelector(".field-error");
    if (messages && messages.length) {
      input.setAttribute("aria-invalid", "true");
      note.textContent = messages.join("\n");
    } else {
      input.removeAttribute("aria-invalid");
      note.textContent = "";
    }
  }

  // The lines of a source list as sent, and where each stands in the textarea (1-based).
  function sourceLines(text) {
    const lines = [];
    text.split(/\r?\n/).forEach((raw, index) => {
      const value = raw.trim();
      if (value) lines.push({ text: value, number: index + 1 });
    });
    return lines;
  }

  function idempotencyKey() {
    if (window.crypto && typeof window.crypto.randomUUID === "function") return window.crypto.randomUUID();
    const bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // -- the whole job, fetched when it is opened -------------------------------------------

  function wholeJob(jobId) {
    const summary = state.jobs.get(jobId);
    const status = summary ? summary.status : null;
    const cached = state.whole.get(jobId);
    if (cached && cached.status === status) return cached.promise;
    const entry = { status, promise: api("GET", "/v1/analyses/" + encodeURIComponent(jobId)) };
    state.whole.set(jobId, entry);
    entry.promise.catch(() => {
      if (state.whole.get(jobId) === entry) state.whole.delete(jobId);
    });
    return entry.promise;
  }

  // -- the event stream -------------------------------------------------------------------

  function setConnection(value) {
    const node = $("connection");
    node.dataset.state = value;
    node.textContent = value;
  }

  function upsert(job, kind) {
    const before = state.jobs.get(job.id);
    if (!before || before.status !== job.status) {
      state.whole.delete(job.id); // its sources and verdicts are read again when opened
      if (before || kind === "admitted") announce(job, before);
    }
    state.jobs.set(job.id, job);
  }

  function connect() {
    disconnect();
    const source = new EventSource("/v1/events?access_token=" + encodeURIComponent(state.token));
    state.source = source;
    setConnection("connecting");
    source.onopen = () => {
      if (state.source === source) setConnection("live");
    };
    source.onerror = () => {
      if (state.source !== source) return;
      if (source.readyState === EventSource.CLOSED) {
        // Not an HTTP 200 stream: the token was refused, or the service is unavailable.
        setConnection("offline");
        afterStreamRefused();
      } else {
        setConnection("reconnecting"); // EventSource retries with Last-Event-ID by itself
      }
    };
    source.addEventListener("snapshot", (event) => {
      const data = JSON.parse(event.data);
      state.jobs = new Map(data.analyses.map((job) => [job.id, job]));
      for (const [jobId, entry] of state.whole) {
        const job = state.jobs.get(jobId);
        if (!job || job.status !== entry.status) state.whole.delete(jobId);
      }
      state.next = data.next || null;
      scheduleRender();
      scheduleCredits();
    });
    source.addEventListener("deleted", (event) => {
      // Removed (here, in another tab, or through the API): it leaves the list.
      const data = JSON.parse(event.data);
      if (data.job && state.jobs.has(data.job.id)) {
        state.announcements.push(jobName(data.job) + " was removed.");
        state.jobs.delete(data.job.id);
        state.whole.delete(data.job.id);
      }
      scheduleRender();
      scheduleCredits();
    });
    source.addEventListener("position", (event) => {
      // Only ids and positions: the jobs themselves came with earlier frames.
      const data = JSON.parse(event.data);
      for (const moved of data.positions || []) {
        const job = state.jobs.get(moved.id);
        if (job) state.jobs.set(moved.id, { ...job, queue_position: moved.queue_position });
      }
      scheduleRender();
    });
    for (const kind of UPSERT_KINDS) {
      source.addEventListener(kind, (event) => {
        const data = JSON.parse(event.data);
        if (data.job) upsert(data.job, kind);
        scheduleRender();
        scheduleCredits();
      });
    }
  }

  function disconnect() {
    if (state.source) state.source.close();
    state.source = null;
    clearTimeout(state.reopenTimer);
  }

  async function afterStreamRefused() {
    try {
      await api("GET", "/v1/credits");
    } catch (error) {
      if (error.status === 401) {
        signOut("The token was refused: " + problemMessage(error));
        return;
      }
    }
    // The token is good: the service was briefly unavailable. Open a new stream (it starts
    // with a snapshot, so nothing is missed).
    state.reopenTimer = setTimeout(() => {
      if (state.token) connect();
    }, REOPEN_DELAY_MS);
  }

  // -- credits ----------------------------------------------------------------------------

  function scheduleCredits() {
    clearTimeout(state.creditsTimer);
    state.creditsTimer = setTimeout(refreshCredits, 150); // one read for a burst of events
  }

  function showBalance(balance) {
    state.balance = balance;
    $("credit-balance").textContent = String(balance);
    $("credit-unit").textContent = balance === 1 ? "credit" : "credits";
    $("credits").hidden = false;
  }

  async function refreshCredits() {
    try {
      showBalance((await api("GET", "/v1/credits")).balance);
    } catch (_ignored) {
      // The next event asks again.
    }
  }

  // -- announcements (aria-live) ------------------------------------------------------------

  function jobName(job) {
    const title = job.thesis && job.thesis.title ? job.thesis.title : "(untitled)";
    return job.delta_of ? "Re-check of " + quoted(title) : quoted(title);
  }

  function verdictSummary(counts) {
    const parts = [];
    for (const [verdict, count] of Object.entries(counts || {})) {
      if (count) parts.push(count + " " + (VERDICTS[verdict] ? VERDICTS[verdict].label : verdict));
    }
    return parts.join(", ");
  }

  function announce(job, before) {
    const name = jobName(job);
    let text = null;
    if (!before) text = name + (job.status === "queued" ? " is queued." : " is starting.");
    else if (job.status === "running") text = name + " started.";
    else if (job.status === "succeeded") text = name + " finished: " + (verdictSummary(job.verdict_counts) || "no verdicts") + ".";
    else if (job.status === "failed") text = name + " failed: " + failureText(job);
    else if (job.status === "cancelled") text = name + " was cancelled.";
    if (text) state.announcements.push(text);
  }

  // A log: each change is a new line, which a screen reader reads once; the oldest go.
  function flushAnnouncements() {
    const log = $("announcer");
    for (const text of state.announcements) log.append(el("p", null, text));
    while (log.children.length > MAX_ANNOUNCED) log.firstElementChild.remove();
    state.announcements = [];
  }

  // -- rendering --------------------------------------------------------------------------

  function scheduleRender() {
    if (state.renderPending) return;
    state.renderPending = true;
    requestAnimationFrame(() => {
      state.renderPending = false;
      render();
    });
  }

  // The time of day; with the date too when it was not today (older analyses).
  function time(iso) {
    if (!iso) return "";
    const when = new Date(iso);
    const clock = { hour: "numeric", minute: "2-digit" };
    if (when.toDateString() === new Date().toDateString()) return when.toLocaleTimeString([], clock);
    return when.toLocaleString([], { month: "short", day: "numeric", ...clock });
  }

  function verdictMark(verdict) {
    const known = VERDICTS[verdict];
    const node = el("span", "verdict");
    node.dataset.verdict = verdict;
    node.append(el("span", "mark", known ? known.mark : "•"), " " + (known ? known.label : verdict));
    node.firstChild.setAttribute("aria-hidden", "true");
    return node;
  }

  function verdictList(verdictCounts) {
    const counts = new Map(Object.entries(verdictCounts || {}));
    const list = el("ul", "verdicts");
    const item = (verdict, count, label, mark) => {
      const entry = el("li", count ? null : "zero");
      entry.dataset.verdict = verdict;
      const sign = el("span", "mark", mark);
      sign.setAttribute("aria-hidden", "true");
      entry.append(sign, el("strong", null, String(count)), " " + label);
      list.append(entry);
    };
    for (const [verdict, known] of Object.entries(VERDICTS)) {
      item(verdict, counts.get(verdict) || 0, known.label, known.mark);
      counts.delete(verdict);
    }
    for (const [verdict, count] of counts) item(verdict, count, verdict, "•");
    return list;
  }

  function failureText(job) {
    const error = job.error || {};
    if (error.code === "analysis_failed" && error.detail) return sentence(error.detail);
    return FAILURES[error.code] || sentence(error.detail) || "No reason was given.";
  }

  function badgeText(job) {
    switch (job.status) {
      case "queued":
        return !job.delta_of && job.queue_position ? "#" + job.queue_position + " in queue" : "waiting";
      case "pending":
        return "starting";
      default:
        return job.status;
    }
  }

  function fillDetail(node, job) {
    node.replaceChildren();
    if (job.status === "running") node.textContent = "Running since " + time(job.started_at);
    else if (job.status === "pending") node.textContent = "Starting…";
    else if (job.status === "queued") {
      node.textContent = "Submitted " + time(job.created_at) + " · " + (WAITING[job.waiting_for] || "waits");
    } else if (job.status === "succeeded") node.append(verdictList(job.verdict_counts));
    else if (job.status === "failed") node.textContent = "Failed: " + failureText(job);
    else if (job.status === "cancelled") {
      const by = CANCELLED_BY[job.error && job.error.code];
      node.textContent =
        "Cancelled" + (by ? " " + by : "") + " at " + time(job.finished_at) +
        (job.started_at ? "" : ", before it started");
    }
  }

  function sourceLink(source) {
    const doi = /^(?:doi:|https:\/\/doi\.org\/)?(10\.\d{4,9}\/\S+)$/i.exec(source);
    const href = doi ? "https://doi.org/" + doi[1] : /^https?:\/\//i.test(source) ? source : null;
    if (!href) return document.createTextNode(source);
    const link = el("a", null, source);
    link.href = href;
    link.target = "_blank";
    link.rel = "noopener noreferrer";
    return link;
  }

  function resultsTable(job) {
    const verdicts = Array.isArray(job.verdicts) ? job.verdicts : [];
    const table = el("table", "results");
    const caption = el("caption", null, "Verdict for each of the " + plural(verdicts.length, "source", "sources"));
    const head = el("thead");
    const headRow = el("tr");
    for (const [label, className] of [["#", "n"], ["Source", "source"], ["Verdict", "verdict-col"]]) {
      const cell = el("th", className, label);
      cell.scope = "col";
      headRow.append(cell);
    }
    head.append(headRow);
    const body = el("tbody");
    verdicts.forEach((entry, index) => {
      const row = el("tr");
      row.dataset.verdict = entry.verdict;
      const source = el("td", "source");
      source.append(sourceLink(String(entry.source)));
      const verdict = el("td", "verdict-col");
      verdict.append(verdictMark(String(entry.verdict)));
      row.append(el("td", "n", String(index + 1)), source, verdict);
      body.append(row);
    });
    table.append(caption, head, body);
    return table;
  }

  // -- one job's element, kept across renders so that focus and what is typed survive ----

  function createView(job) {
    const view = {
      job,
      li: el("li", "job"),
      badge: el("span", "badge"),
      name: el("div", "job-name"),
      title: null,
      kind: el("span", "kind", "Re-check"),
      meta: el("span", "meta"),
      actions: el("div", "job-actions"),
      cancel: button("Cancel", "cancel"),
      recheck: button("Re-check", "secondary recheck"),
      remove: button("Remove", "secondary remove"),
      body: el("div", "job-body"),
      detail: el("div", "detail"),
      error: el("p", "error job-error"),
      panel: el("div", "panel"),
      form: null,
      rechecks: el("ul", "jobs rechecks"),
      open: false,
      loads: 0,
      signature: null,
    };
    view.error.setAttribute("role", "alert");
    view.recheck.setAttribute("aria-expanded", "false");
    view.panel.id = "results-" + job.id;
    view.panel.hidden = true;
    view.rechecks.hidden = true;
    view.name.append(view.kind, view.meta);
    view.actions.append(view.recheck, view.cancel, view.remove);
    view.body.append(view.detail, view.error, view.panel, view.rechecks);
    view.li.append(view.badge, view.name, view.actions, view.body);
    view.cancel.addEventListener("click", () => cancelJob(view));
    view.remove.addEventListener("click", () => removeJob(view));
    view.recheck.addEventListener("click", () => toggleRecheck(view));
    return view;
  }

  function ensureTitle(view, job, nested) {
    const openable = job.status === "succeeded";
    const thesis = job.thesis && job.thesis.title ? job.thesis.title : "(untitled)";
    // Under its original, a re-check need not repeat the thesis: it is named by what it checks.
    const text = nested ? "Re-check of " + plural(job.source_count || 0, "source", "sources") : thesis;
    if (!view.title || view.title.dataset.openable !== String(openable)) {
      const title = openable ? button(text, "title toggle") : el("span", "title", text);
      title.dataset.openable = String(openable);
      if (openable) {
        title.setAttribute("aria-controls", view.panel.id);
        title.setAttribute("aria-expanded", String(view.open));
        title.addEventListener("click", () => toggleResults(view));
      } else if (view.open) {
        closeResults(view);
      }
      if (view.title) view.title.replaceWith(title);
      else view.name.prepend(title);
      view.title = title;
    }
    view.title.textContent = text;
    if (openable) view.title.setAttribute("aria-label", (job.delta_of ? "Results of the re-check of " : "Results of ") + thesis);
  }

  function updateView(view, job, nested) {
    const before = view.job;
    view.job = job;
    const li = view.li;
    li.className = "job status-" + job.status + (job.delta_of ? " is-recheck" : "");
    li.dataset.jobId = job.id;
    li.dataset.status = job.status;
    if (job.status === "queued") {
      // A re-check never stands in its user's queue: it has no position.
      if (job.queue_position && !job.delta_of) li.dataset.position = String(job.queue_position);
      else delete li.dataset.position;
      li.dataset.waitingFor = job.waiting_for;
    } else {
      delete li.dataset.position;
      delete li.dataset.waitingFor;
    }
    if (job.delta_of) li.dataset.recheckOf = job.delta_of;
    else delete li.dataset.recheckOf;

    const signature = JSON.stringify(job) + (nested ? " nested" : "");
    if (signature === view.signature) return;
    view.signature = signature;
    view.badge.textContent = badgeText(job);
    ensureTitle(view, job, nested);
    view.kind.hidden = !job.delta_of || nested;
    view.meta.textContent = nested
      ? "submitted " + time(job.created_at)
      : plural(job.source_count || 0, "source", "sources");
    const name = jobName(job);
    view.cancel.hidden = !OPEN.has(job.status);
    view.cancel.setAttribute("aria-label", "Cancel " + name);
    view.remove.hidden = !TERMINAL.has(job.status);
    view.remove.setAttribute("aria-label", "Remove " + name + " from the list");
    view.recheck.hidden = job.status !== "succeeded";
    view.recheck.setAttribute("aria-label", "Re-check sources of " + name);
    if (job.status !== "succeeded" && view.form) closeRecheck(view, false);
    fillDetail(view.detail, job);
    if (before.status !== job.status) view.error.textContent = "";
    if (view.open && before.status !== job.status) loadResults(view);
  }

  function viewOf(job, nested) {
    let view = state.views.get(job.id);
    if (!view) {
      view = createView(job);
      state.views.set(job.id, view);
    }
    updateView(view, job, Boolean(nested));
    return view;
  }

  // Put `nodes` into `list` in order, moving only what is out of place (a moved node loses
  // focus), and take out the rest.
  function place(list, nodes) {
    nodes.forEach((node, index) => {
      const at = list.children[index];
      if (at !== node) list.insertBefore(node, at || null);
    });
    while (list.children.length > nodes.length) list.lastElementChild.remove();
  }

  // The user's current work: the jobs since they last had nothing open. Each job spans its
  // admission to its end (open: to now); the batch is the last run of overlapping spans.
  function currentBatch(jobs) {
    const spans = jobs
      .map((job) => {
        const start = Date.parse(job.created_at);
        const end = TERMINAL.has(job.status) ? Date.parse(job.finished_at || job.created_at) : Infinity;
        return { job, start, end };
      })
      .sort((a, b) => a.start - b.start);
    let batch = [];
    let reach = -Infinity;
    for (const span of spans) {
      if (span.start > reach) batch = [];
      batch.push(span.job);
      reach = Math.max(reach, span.end);
    }
    return batch;
  }

  function renderBatch(jobs) {
    const batch = currentBatch(jobs);
    const count = (test) => batch.filter(test).length;
    const first = (job) => !job.delta_of;
    const running = count((j) => first(j) && (j.status === "running" || j.status === "pending"));
    const queued = count((j) => first(j) && j.status === "queued");
    const done = count((j) => first(j) && TERMINAL.has(j.status));
    const failed = count((j) => first(j) && j.status === "failed");
    const cancelled = count((j) => first(j) && j.status === "cancelled");
    const rechecks = count((j) => !first(j) && OPEN.has(j.status));
    const node = $("batch");
    if (!batch.length) {
      node.textContent = "Nothing started yet.";
      return;
    }
    let text = running + " running · " + queued + " queued · " + done + " done";
    const ended = [];
    if (failed) ended.push(failed + " failed");
    if (cancelled) ended.push(cancelled + " cancelled");
    if (ended.length) text += " (" + ended.join(", ") + ")";
    if (rechecks) text += " · " + plural(rechecks, "re-check", "re-checks") + " open";
    node.textContent = text;
  }

  function fill(listId, views) {
    place($(listId), views.map((view) => view.li));
    $(listId + "-count").textContent = String(views.length);
    document.querySelector('[data-empty-for="' + listId + '"]').hidden = views.length > 0;
  }

  function render() {
    const jobs = Array.from(state.jobs.values());
    for (const [jobId, view] of state.views) {
      if (!state.jobs.has(jobId)) {
        view.li.remove();
        state.views.delete(jobId);
      }
    }
    const byCreated = (a, b) => a.created_at.localeCompare(b.created_at);
    // Re-checks show under their original; one whose original is not on the page stands alone.
    const rechecksOf = new Map();
    const top = [];
    for (const job of jobs) {
      if (job.delta_of && state.jobs.has(job.delta_of)) {
        if (!rechecksOf.has(job.delta_of)) rechecksOf.set(job.delta_of, []);
        rechecksOf.get(job.delta_of).push(job);
      } else {
        top.push(job);
      }
    }
    const views = (list) => list.map((job) => viewOf(job, false));
    fill("running", views(top.filter((j) => j.status === "running" || j.status === "pending").sort(byCreated)));
    fill(
      "queued",
      views(
        top
          .filter((j) => j.status === "queued")
          .sort((a, b) => (a.queue_position || 0) - (b.queue_position || 0) || byCreated(a, b)),
      ),
    );
    fill(
      "finished",
      views(
        top
          .filter((j) => TERMINAL.has(j.status))
          .sort((a, b) => (b.finished_at || "").localeCompare(a.finished_at || "")),
      ),
    );
    for (const job of jobs) {
      const view = state.views.get(job.id);
      if (!view) continue;
      const own = (rechecksOf.get(job.id) || []).sort(byCreated);
      place(view.rechecks, own.map((recheck) => viewOf(recheck, true).li));
      view.rechecks.hidden = own.length === 0;
      if (own.length) view.rechecks.setAttribute("aria-label", "Re-checks of " + jobName(job));
    }
    renderBatch(jobs);
    $("older").hidden = !state.next;
    flushAnnouncements();
  }

  // -- per-citation results -----------------------------------------------------------------

  function toggleResults(view) {
    if (view.open) closeResults(view);
    else {
      view.open = true;
      view.panel.hidden = false;
      view.title.setAttribute("aria-expanded", "true");
      loadResults(view);
    }
  }

  function closeResults(view) {
    view.open = false;
    view.panel.hidden = true;
    if (view.title) view.title.setAttribute("aria-expanded", "false");
  }

  async function loadResults(view) {
    const load = ++view.loads;
    const jobId = view.job.id;
    view.panel.replaceChildren(el("p", "panel-status", "Loading the results…"));
    try {
      const job = await wholeJob(jobId);
      if (load === view.loads) view.panel.replaceChildren(resultsTable(job));
    } catch (failure) {
      if (load !== view.loads) return;
      const again = button("Try again", "secondary");
      again.addEventListener("click", () => loadResults(view));
      const note = el("p", "error", "The results could not be loaded. " + problemMessage(failure) + " ");
      note.append(again);
      view.panel.replaceChildren(note);
    }
  }

  // -- re-checks ----------------------------------------------------------------------------

  function recheckForm(view) {
    const base = "recheck-" + view.job.id;
    const form = el("form", "recheck-form");
    form.noValidate = true;
    const label = el("label", null, "Sources to re-check, one DOI or URL per line");
    label.htmlFor = base;
    const hint = el("p", "hint");
    hint.id = base + "-hint";
    const sources = el("textarea");
    sources.id = base;
    sources.rows = 4;
    sources.spellcheck = false;
    sources.setAttribute("aria-describedby", hint.id + " " + base + "-error");
    const error = el("p", "field-error");
    error.id = base + "-error";
    const start = el("button", null, "Start re-check");
    start.type = "submit";
    const close = button("Close", "secondary");
    const actions = el("div", "actions");
    actions.append(start, close);
    const general = el("p", "error");
    general.setAttribute("role", "alert");
    form.append(label, hint, sources, error, actions, general);
    close.addEventListener("click", () => closeRecheck(view, true));
    form.addEventListener("keydown", (event) => {
      if (event.key === "Escape") closeRecheck(view, true);
    });
    sources.addEventListener("input", () => showFieldError(sources.id, null));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      startRecheck(view, { form, sources, start, general });
    });
    return { form, sources, hint, start, general };
  }

  async function toggleRecheck(view) {
    if (view.form) {
      closeRecheck(view, true);
      return;
    }
    const parts = recheckForm(view);
    view.form = parts;
    view.body.insertBefore(parts.form, view.rechecks);
    view.recheck.setAttribute("aria-expanded", "true");
    parts.sources.disabled = true;
    parts.sources.value = "";
    parts.hint.textContent = "Loading the sources…";
    try {
      const job = await wholeJob(view.job.id);
      if (view.form !== parts) return;
      prefill(parts, job);
    } catch (failure) {
      if (view.form !== parts) return;
      parts.hint.textContent = "";
      parts.general.textContent = "The sources could not be loaded. " + problemMessage(failure);
    }
    parts.sources.disabled = false;
    parts.sources.focus();
  }

  // A delta re-check is for the citations that did not hold: those come first to hand.
  function prefill(parts, job) {
    const all = (job.verdicts || []).map((v) => String(v.source));
    const doubtful = (job.verdicts || []).filter((v) => v.verdict !== "supported").map((v) => String(v.source));
    const chosen = doubtful.length ? doubtful : all.length ? all : job.sources || [];
    parts.sources.value = chosen.join("\n");
    parts.hint.replaceChildren();
    if (doubtful.length && doubtful.length < all.length) {
      parts.hint.append(
        "Filled in with the " + plural(doubtful.length, "source", "sources") +
          " that were not supported. Correct them, add or remove lines, or ",
      );
      const everything = button("use all " + all.length, "link");
      everything.addEventListener("click", () => {
        parts.sources.value = all.join("\n");
        parts.sources.focus();
      });
      parts.hint.append(everything, ".");
    } else {
      parts.hint.textContent = "Correct the sources, add or remove lines, then start the re-check.";
    }
  }

  function closeRecheck(view, giveFocus) {
    if (!view.form) return;
    view.form.form.remove();
    view.form = null;
    view.recheck.setAttribute("aria-expanded", "false");
    if (giveFocus && !view.recheck.hidden) view.recheck.focus();
  }

  async function startRecheck(view, parts) {
    const lines = sourceLines(parts.sources.value);
    parts.start.disabled = true;
    parts.general.textContent = "";
    showFieldError(parts.sources.id, null);
    try {
      // The re-check appears under this analysis when its "admitted" event arrives.
      await api("POST", "/v1/analyses/" + encodeURIComponent(view.job.id) + "/rechecks", {
        sources: lines.map((line) => line.text),
      });
      closeRecheck(view, true);
    } catch (failure) {
      if (failure.status === 401) {
        signOut("The token was refused: " + problemMessage(failure));
        return;
      }
      const found = fieldProblems(failure, { sources: parts.sources.id }, lines);
      showFieldError(parts.sources.id, found.byInput.get(parts.sources.id));
      parts.general.textContent = found.general.join("\n");
      if (found.byInput.size) parts.sources.focus();
    } finally {
      parts.start.disabled = false;
    }
  }

  // -- actions ----------------------------------------------------------------------------

  function clearSubmitErrors() {
    for (const input of ["title", "document-url", "sources"]) showFieldError(input, null);
    $("submit-error").textContent = "";
  }

  async function submitAnalysis(event) {
    event.preventDefault();
    const submit = $("submit-button");
    const lines = sourceLines($("sources").value);
    const title = $("title").value.trim();
    const body = {
      thesis: { title, document_url: $("document-url").value.trim() },
      sources: lines.map((line) => line.text),
    };
    submit.disabled = true;
    clearSubmitErrors();
    $("submit-note").textContent = "";
    try {
      // The new job appears when its "admitted" event arrives, like every other change.
      await api("POST", "/v1/analyses", body, { "Idempotency-Key": idempotencyKey() });
      // The next thesis often cites the same sources: only the title and document clear.
      $("title").value = "";
      $("document-url").value = "";
      $("submit-note").textContent = "Started " + quoted(title) + ". The sources are kept for the next thesis.";
      $("title").focus();
    } catch (failure) {
      if (failure.status === 401) {
        signOut("The token was refused: " + problemMessage(failure));
        return;
      }
      const found = fieldProblems(failure, SUBMIT_FIELDS, lines);
      for (const [input, messages] of found.byInput) showFieldError(input, messages);
      $("submit-error").textContent = found.general.join("\n");
      const first = ["title", "document-url", "sources"].find((input) => found.byInput.has(input));
      if (first) $(first).focus();
    } finally {
      submit.disabled = false;
    }
  }

  // A cancelled job stays in the list, cancelled: its "cancelled" event moves it to Finished.
  async function cancelJob(view) {
    const jobId = view.job.id;
    view.cancel.disabled = true;
    view.error.textContent = "";
    try {
      await api("POST", "/v1/analyses/" + encodeURIComponent(jobId) + "/cancel");
    } catch (failure) {
      if (failure.status === 401) {
        signOut("The token was refused: " + problemMessage(failure));
        return;
      }
      view.error.textContent =
        failure.status === 409
          ? "It finished before it could be cancelled."
          : "It could not be cancelled. " + problemMessage(failure);
    } finally {
      view.cancel.disabled = false;
    }
  }

  // A finished job leaves the list for good (there is no undo): its "deleted" event takes it out.
  async function removeJob(view) {
    const job = view.job;
    if (!window.confirm("Remove " + jobName(job) + " from the list? It cannot be brought back.")) return;
    // Its element goes with the event, perhaps before the answer: keep the keyboard in the
    // list it stood in.
    const card = view.li.closest("section.card");
    const heading = card && card.querySelector("h3");
    const focused = view.li.contains(document.activeElement);
    view.remove.disabled = true;
    view.error.textContent = "";
    try {
      await api("DELETE", "/v1/analyses/" + encodeURIComponent(job.id));
      const lost = view.li.contains(document.activeElement) || document.activeElement === document.body;
      if (heading && focused && lost) {
        heading.tabIndex = -1;
        heading.focus();
      }
    } catch (failure) {
      if (failure.status === 401) {
        signOut("The token was refused: " + problemMessage(failure));
        return;
      }
      view.error.textContent = "It could not be removed. " + problemMessage(failure);
    } finally {
      view.remove.disabled = false;
    }
  }

  async function showOlder() {
    const more = $("older");
    more.disabled = true;
    $("older-error").textContent = "";
    try {
      const page = await api("GET", "/v1/analyses?limit=" + OLDER_PAGE + "&cursor=" + encodeURIComponent(state.next));
      // What the stream already told is newer than a page read now: it is kept.
      for (const job of page.analyses) if (!state.jobs.has(job.id)) state.jobs.set(job.id, job);
      state.next = page.next || null;
      scheduleRender();
    } catch (failure) {
      $("older-error").textContent = "The older analyses could not be loaded. " + problemMessage(failure);
    } finally {
      more.disabled = false;
    }
  }

  function updateSourceCount() {
    const count = sourceLines($("sources").value).length;
    $("source-count").textContent = count ? plural(count, "source", "sources") : "";
  }

  function resetWorkspace() {
    state.jobs = new Map();
    state.whole = new Map();
    state.next = null;
    for (const view of state.views.values()) view.li.remove();
    state.views = new Map();
    state.announcements = [];
    $("announcer").replaceChildren();
  }

  async function signIn(token) {
    state.token = token;
    try {
      showBalance((await api("GET", "/v1/credits")).balance); // checks the token before the stream
    } catch (failure) {
      state.token = null;
      if (failure.status === 401) sessionStorage.removeItem(TOKEN_KEY);
      $("sign-in-error").textContent =
        failure.status === 401 ? "The token was refused: " + problemMessage(failure) : problemMessage(failure);
      $("token").setAttribute("aria-invalid", "true");
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    state.user = tokenSubject(token);
    $("user-name").textContent = state.user || "unknown user";
    $("user").title = "Signed in as " + (state.user || "an unknown user");
    $("user").hidden = false;
    $("token").removeAttribute("aria-invalid");
    $("sign-in-error").textContent = "";
    $("sign-in").hidden = true;
    $("workspace").hidden = false;
    $("sign-out").hidden = false;
    resetWorkspace();
    render();
    connect();
    $("title").focus();
  }

  function signOut(message) {
    disconnect();
    clearTimeout(state.creditsTimer);
    sessionStorage.removeItem(TOKEN_KEY);
    state.token = null;
    state.user = null;
    state.balance = null;
    resetWorkspace();
    setConnection("offline");
    $("workspace").hidden = true;
    $("sign-out").hidden = true;
    $("credits").hidden = true;
    $("user").hidden = true;
    $("sign-in").hidden = false;
    $("sign-in-error").textContent = message || "";
    $("token").value = "";
    $("token").focus();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token").value.trim().replace(/^Bearer\s+/i, "");
      if (token) signIn(token);
      else $("sign-in-error").textContent = "Paste a token first.";
    });
    $("submit-form").addEventListener("submit", submitAnalysis);
    for (const input of ["title", "document-url", "sources"]) {
      $(input).addEventListener("input", () => showFieldError(input, null));
    }
    $("sources").addEventListener("input", updateSourceCount);
    $("clear-sources").addEventListener("click", () => {
      $("sources").value = "";
      showFieldError("sources", null);
      updateSourceCount();
      $("sources").focus();
    });
    $("older").addEventListener("click", showOlder);
    $("sign-out").addEventListener("click", () => signOut());
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) signIn(saved);
  });
})();
