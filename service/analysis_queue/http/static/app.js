// The dashboard: sign in with a pasted token, submit analyses, watch them live, cancel queued
// ones. The list changes only on events from GET /v1/events (an EventSource, which reconnects
// by itself with Last-Event-ID); credits are re-read after events. Nothing polls.
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
  const VERDICT_LABELS = {
    supported: "supported",
    partially_supported: "partially supported",
    unsupported: "unsupported",
    not_found: "not found",
  };
  const REOPEN_DELAY_MS = 3000;

  const state = {
    token: null,
    jobs: new Map(),
    source: null,
    renderPending: false,
    creditsTimer: null,
    reopenTimer: null,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // -- HTTP -------------------------------------------------------------------------------

  async function api(method, path, body, headers) {
    const init = { method, headers: { Authorization: "Bearer " + state.token, ...(headers || {}) } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try {
      data = await response.json();
    } catch (_ignored) {
      data = null;
    }
    if (!response.ok) {
      const error = new Error(describeProblem(data, response.status));
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function describeProblem(problem, status) {
    if (!problem || typeof problem !== "object") return "The request failed (HTTP " + status + ").";
    const lines = [problem.detail || problem.title || "The request failed (HTTP " + status + ")."];
    if (Array.isArray(problem.errors)) {
      for (const item of problem.errors) lines.push(item.field + ": " + item.message);
    }
    return lines.join("\n");
  }

  function idempotencyKey() {
    if (window.crypto && typeof window.crypto.randomUUID === "function") return window.crypto.randomUUID();
    const bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // -- the event stream -------------------------------------------------------------------

  function setConnection(value) {
    const node = $("connection");
    node.dataset.state = value;
    node.textContent = value;
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
      scheduleRender();
      scheduleCredits();
    });
    source.addEventListener("deleted", (event) => {
      const data = JSON.parse(event.data);
      if (data.job) state.jobs.delete(data.job.id);
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
        if (data.job) state.jobs.set(data.job.id, data.job);
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
        signOut("The token was refused: " + error.message);
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

  async function refreshCredits() {
    try {
      const data = await api("GET", "/v1/credits");
      $("credit-balance").textContent = String(data.balance);
      $("credits").hidden = false;
    } catch (_ignored) {
      // The next event asks again.
    }
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

  function time(iso) {
    return iso ? new Date(iso).toLocaleTimeString() : "";
  }

  function verdictList(verdictCounts) {
    const counts = new Map(Object.entries(verdictCounts || {}));
    const list = el("ul", "verdicts");
    for (const [verdict, label] of Object.entries(VERDICT_LABELS)) {
      const item = el("li");
      item.dataset.verdict = verdict;
      item.append(el("strong", null, String(counts.get(verdict) || 0)), " " + label);
      list.append(item);
      counts.delete(verdict);
    }
    for (const [verdict, count] of counts) {
      const item = el("li");
      item.dataset.verdict = verdict;
      item.append(el("strong", null, String(count)), " " + verdict);
      list.append(item);
    }
    return list;
  }

  function badgeText(job) {
    switch (job.status) {
      case "queued":
        return job.queue_position ? "#" + job.queue_position + " in queue" : "waiting";
      case "pending":
        return "starting";
      default:
        return job.status;
    }
  }

  function detail(job) {
    const node = el("div", "detail");
    if (job.status === "running") node.textContent = "Running since " + time(job.started_at);
    else if (job.status === "pending") node.textContent = "Starting…";
    else if (job.status === "queued") {
      node.textContent = "Submitted " + time(job.created_at) + " · " + WAITING[job.waiting_for];
    }
    else if (job.status === "succeeded") node.append(verdictList(job.verdict_counts));
    else if (job.status === "failed") {
      node.textContent = "Failed: " + (job.error ? job.error.detail || job.error.code : "unknown reason");
    } else if (job.status === "cancelled") node.textContent = "Cancelled " + time(job.finished_at);
    return node;
  }

  function jobItem(job) {
    const item = el("li", "job status-" + job.status);
    item.dataset.jobId = job.id;
    item.dataset.status = job.status;
    if (job.status === "queued") {
      item.dataset.position = String(job.queue_position);
      item.dataset.waitingFor = job.waiting_for;
    }
    const title = job.thesis && job.thesis.title ? job.thesis.title : "(untitled)";
    item.append(el("span", "badge", badgeText(job)), el("span", "title", title));
    if (OPEN.has(job.status)) {
      const cancel = el("button", "cancel", "Cancel");
      cancel.type = "button";
      cancel.setAttribute("aria-label", "Cancel " + title);
      cancel.addEventListener("click", () => cancelJob(job.id, cancel));
      item.append(cancel);
    } else {
      item.append(el("span"));
    }
    item.append(detail(job));
    return item;
  }

  function fill(listId, jobs) {
    const list = $(listId);
    list.replaceChildren(...jobs.map(jobItem));
    $(listId + "-count").textContent = String(jobs.length);
    document.querySelector('[data-empty-for="' + listId + '"]').hidden = jobs.length > 0;
  }

  function render() {
    const jobs = Array.from(state.jobs.values());
    const byCreated = (a, b) => a.created_at.localeCompare(b.created_at);
    fill("running", jobs.filter((j) => j.status === "running" || j.status === "pending").sort(byCreated));
    fill(
      "queued",
      jobs.filter((j) => j.status === "queued").sort((a, b) => (a.queue_position || 0) - (b.queue_position || 0)),
    );
    fill(
      "finished",
      jobs
        .filter((j) => TERMINAL.has(j.status))
        .sort((a, b) => (b.finished_at || "").localeCompare(a.finished_at || "")),
    );
  }

  // -- actions ----------------------------------------------------------------------------

  async function submitAnalysis(event) {
    event.preventDefault();
    const button = $("submit-button");
    const error = $("submit-error");
    const sources = $("sources")
      .value.split(/\r?\n/)
      .map((line) => line.trim())
      .filter((line) => line.length > 0);
    const body = {
      thesis: { title: $("title").value.trim(), document_url: $("document-url").value.trim() },
      sources,
    };
    button.disabled = true;
    error.textContent = "";
    try {
      // The new job appears when its "admitted" event arrives, like every other change.
      await api("POST", "/v1/analyses", body, { "Idempotency-Key": idempotencyKey() });
      $("submit-form").reset();
      $("title").focus();
    } catch (failure) {
      error.textContent = failure.message;
    } finally {
      button.disabled = false;
    }
  }

  async function cancelJob(jobId, button) {
    button.disabled = true;
    try {
      await api("DELETE", "/v1/analyses/" + encodeURIComponent(jobId));
    } catch (failure) {
      button.disabled = false;
      $("submit-error").textContent = failure.message;
    }
  }

  async function signIn(token) {
    state.token = token;
    try {
      await api("GET", "/v1/credits"); // checks the token before opening the stream
    } catch (failure) {
      state.token = null;
      $("sign-in-error").textContent =
        failure.status === 401 ? "The token was refused: " + failure.message : failure.message;
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    $("sign-in-error").textContent = "";
    $("sign-in").hidden = true;
    $("workspace").hidden = false;
    $("sign-out").hidden = false;
    state.jobs = new Map();
    render();
    connect();
    $("title").focus();
  }

  function signOut(message) {
    disconnect();
    clearTimeout(state.creditsTimer);
    sessionStorage.removeItem(TOKEN_KEY);
    state.token = null;
    state.jobs = new Map();
    setConnection("offline");
    $("workspace").hidden = true;
    $("sign-out").hidden = true;
    $("credits").hidden = true;
    $("sign-in").hidden = false;
    $("sign-in-error").textContent = message || "";
    $("token").value = "";
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token").value.trim().replace(/^Bearer\s+/i, "");
      if (token) signIn(token);
      else $("sign-in-error").textContent = "Paste a token first.";
    });
    $("submit-form").addEventListener("submit", submitAnalysis);
    $("sign-out").addEventListener("click", () => signOut());
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) signIn(saved);
  });
})();
