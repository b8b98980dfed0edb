// The ceiling: BullMQ's own classes over a backend that costs nothing. Its
// jobs live in this process's memory, every call answers at once, and nothing
// is kept past the process. Not a queue to use: no locks, no retries, no
// delays, no events, no durability. It measures what BullMQ's own JavaScript
// costs a job on this machine in this hour, which bounds any backend's jobs a
// second, Loam's and Redis's alike: issue 3's goals are ratios to Redis,
// and the ceiling's ratio to Redis says how far one could go at all.
//
// It serves the scenarios `ceilingScenarios` names and nothing else: any other
// member BullMQ reaches for throws, so a scenario that needs more fails
// loudly rather than measuring a backend that skipped work.
import { EventEmitter } from 'node:events';

/** The scenarios this backend serves: adding, and processing jobs that succeed. */
export const ceilingScenarios = [
  'add one at a time',
  'addBulk',
  'process at concurrency 1',
  'process at concurrency 10',
  'process at concurrency 100',
  '1,000 flows of 1 parent + 10 children',
];

/** A queue's jobs, shared by every backend of that queue in this process. */
class Jobs {
  byId = new Map();
  /** Waiting ids in order; `head` is the next to take (a shifting array costs a copy a job). */
  waiting = [];
  head = 0;
  lastId = 0;
  /** Resolvers of `waitForJob` calls blocked on this queue. */
  waiters = new Set();

  /** Stores a job; one that waits for its children is not yet ready to take. */
  add(job, jobId, waitsForChildren = false) {
    const id = jobId || job.id || String(++this.lastId);
    this.byId.set(id, { ...job, id, pending: 0, processed: {} });
    if (!waitsForChildren) this.ready(id);
    return id;
  }

  ready(id) {
    this.waiting.push(id);
    for (const wake of this.waiters) wake(true);
  }

  /** BullMQ's next-job tuple: the job, its id, no rate limit, no delay. */
  take() {
    if (this.head === this.waiting.length) return [null, 0, 0, 0];
    const id = this.waiting[this.head++];
    if (this.head === this.waiting.length) {
      this.waiting = [];
      this.head = 0;
    }
    const job = this.byId.get(id);
    job.processedOn = Date.now();
    job.attemptsStarted = (job.attemptsStarted ?? 0) + 1;
    return [job, id, 0, 0];
  }

  get anyReady() {
    return this.head < this.waiting.length;
  }
}

const queues = new Map();

/**
 * Drops every queue's jobs, between scenarios: the jobs one scenario left
 * (added and never processed) would otherwise stay in the heap the later
 * scenarios run in.
 */
export function forgetCeilingJobs() {
  queues.clear();
}

/** The jobs of the queue `${prefix}:${queueName}`. */
const jobsOf = (queueKey) => {
  if (!queues.has(queueKey)) queues.set(queueKey, new Jobs());
  return queues.get(queueKey);
};

class CeilingBackend extends EventEmitter {
  closing = undefined;
  keys = {};
  minimumBlockTimeout = 0.001;
  maximumBlockTimeout = 10;
  #blocked = new Set();

  constructor(queueName, prefix) {
    super();
    this.queueName = queueName;
    this.prefix = prefix;
    this.jobs = jobsOf(`${prefix}:${queueName}`);
  }

  get qualifiedName() {
    return `${this.prefix}:${this.queueName}`;
  }
  toKey(type) {
    return `${this.qualifiedName}:${type}`;
  }
  clientName(suffix = '') {
    return `${this.qualifiedName}${suffix}`;
  }
  forQueue(queueName, prefix) {
    return new CeilingBackend(queueName, prefix ?? this.prefix);
  }

  async waitUntilReady() {}
  async setName() {}
  async disconnect() {
    await this.disconnectBlocking();
  }
  close() {
    this.closing ??= this.disconnectBlocking().then(() => {
      this.emit('close');
    });
    return this.closing;
  }

  async addJob(job, jobId) {
    return this.jobs.add(job, jobId);
  }
  async addJobs(entries) {
    return entries.map(({ job, jobId }) => this.jobs.add(job, jobId));
  }

  /** A tree of jobs: each child counts towards its parent, which is ready once none is pending. */
  async addFlow(entries) {
    const waitingForChildren = new Map();
    const ids = entries.map(({ jobData, jobId, parentKeyOpts, prefix, queueName }) => {
      const jobs = jobsOf(`${prefix}:${queueName}`);
      const id = jobs.add(jobData, jobId, parentKeyOpts?.addToWaitingChildren);
      if (parentKeyOpts?.addToWaitingChildren) waitingForChildren.set(jobs.byId.get(id), jobs);
      if (jobData.parent) jobsOf(jobData.parent.queueKey).byId.get(jobData.parent.id).pending++;
      return [null, id];
    });
    // A parent whose children were all given elsewhere has none to wait for.
    for (const [parent, jobs] of waitingForChildren) if (parent.pending === 0) jobs.ready(parent.id);
    return ids;
  }
  async getProcessedChildrenValues(jobId) {
    return this.jobs.byId.get(jobId).processed;
  }

  async moveToActive() {
    return this.jobs.take();
  }
  async waitForJob(blockTimeout) {
    if (this.jobs.anyReady) return { member: '0', score: 0 };
    const ready = await new Promise((resolve) => {
      const done = (found) => {
        clearTimeout(timer);
        this.jobs.waiters.delete(done);
        this.#blocked.delete(done);
        resolve(found);
      };
      const timer = setTimeout(() => done(false), blockTimeout * 1000);
      this.jobs.waiters.add(done);
      this.#blocked.add(done);
    });
    return ready ? { member: '0', score: 0 } : null;
  }
  async disconnectBlocking() {
    for (const done of [...this.#blocked]) done(false);
  }
  async reconnectBlocking() {}
  async extendLock() {
    return 1;
  }
  async extendLocks() {
    return [];
  }
  async moveStalledJobsToWait() {
    return [];
  }
  async isMaxed() {
    return false;
  }
  async moveToCompleted(job, returnValue, _removeOnComplete, _token, fetchNext) {
    const finishedOn = Date.now();
    const stored = this.jobs.byId.get(job.id);
    stored.finishedOn = finishedOn;
    stored.returnvalue = JSON.stringify(returnValue);
    if (stored.parent) {
      const parentJobs = jobsOf(stored.parent.queueKey);
      const parent = parentJobs.byId.get(stored.parent.id);
      parent.processed[`${this.qualifiedName}:${job.id}`] = stored.returnvalue;
      if (--parent.pending === 0) parentJobs.ready(parent.id);
    }
    // A finished job is read no more (its parent keeps its value): keeping it
    // would grow the heap by every job processed.
    this.jobs.byId.delete(job.id);
    if (!fetchNext) return { result: undefined, finishedOn };
    const next = this.jobs.take();
    return { result: next[0] === null ? [] : next, finishedOn };
  }
  async getRateLimitTtl() {
    return 0;
  }
}

/**
 * BullMQ's `BackendFactory` for the ceiling. Each backend is wrapped so that
 * a member it lacks throws when BullMQ reads it, naming the member. A method
 * is bound to the backend (its private fields refuse the proxy as `this`)
 * once, not at each call.
 */
export function ceilingBackend() {
  return (name, opts) => {
    const bound = new Map();
    return new Proxy(new CeilingBackend(name, opts?.prefix ?? 'bull'), {
      get(target, member, receiver) {
        if (typeof member === 'string' && !(member in target) && member !== 'then') {
          throw new Error(`the ceiling backend serves only ${ceilingScenarios.join('; ')}: BullMQ asked for ${member}`);
        }
        const value = Reflect.get(target, member, receiver);
        if (typeof value !== 'function') return value;
        let method = bound.get(member);
        if (method?.of !== value) {
          method = { of: value, call: value.bind(target) };
          bound.set(member, method);
        }
        return method.call;
      },
    });
  };
}
