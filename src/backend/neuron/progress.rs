//! Progress of the Neuron backend's long operations (capturing buckets, compiling graphs), as
//! `tracing` spans the binary turns into progress bars.
//!
//! The library never draws: a [`Progress`] is a `DEBUG` span with target [`TARGET`], named
//! `progress`, with fields [`field::TASK`] (what is being done, `compiling 12 graphs`) and
//! [`field::TOTAL`] (how many steps); each [`Progress::update`] is a `DEBUG` event inside it with
//! [`field::DONE`] (steps finished) and [`field::CURRENT`] (what is in flight). Dropping the
//! `Progress` closes the span, which ends the task (also on an error path). The `deepinfer`
//! binary draws one indicatif bar per open span when stderr is a terminal; with
//! `DEEPINFER_LOG=debug` the same reports are log lines; otherwise they cost nothing (a disabled
//! span records nothing).
//!
//! Why spans and not a progress callback in [`CompilerConfig`](super::compile::CompilerConfig):
//! the capture loop that reports progress too runs inside `runner::open`, which the CLI, the
//! server, the tests and the benches all call without any UI hook; a callback would have to be
//! threaded through every constructor, or kept in a global, and `tracing`'s subscriber already
//! is that global, installed once by the binary. Rejected: one `INFO` line per graph, which
//! would add default stderr lines to every command that captures (`tests/cli.rs` counts them).

use std::fmt;

/// The target of every progress span and event (what the binary's bar layer listens to).
pub const TARGET: &str = "deepinfer::progress";

/// The names of the fields progress spans and events carry.
pub mod field {
    /// Span field: what is being done (`compiling 12 graphs`).
    pub const TASK: &str = "task";
    /// Span field: the number of steps, as a `u64`.
    pub const TOTAL: &str = "total";
    /// Event field: steps finished so far, as a `u64`.
    pub const DONE: &str = "done";
    /// Event field: what is in flight now (graph names), possibly empty.
    pub const CURRENT: &str = "current";
}

/// A long task with a known number of steps; reports nothing once dropped.
#[must_use = "the task ends when the Progress is dropped"]
pub struct Progress {
    span: tracing::Span,
}

impl Progress {
    /// Starts `task` (`capturing 12 graphs`) with `total` steps.
    pub fn start(task: &str, total: usize) -> Self {
        Progress {
            span: tracing::debug_span!(target: TARGET, "progress", task, total = total as u64),
        }
    }

    /// A task nobody hears about (the user turned progress off).
    pub fn hidden() -> Self {
        Progress {
            span: tracing::Span::none(),
        }
    }

    /// `done` steps are finished; `current` is what runs now (graph names, or empty).
    pub fn update(&self, done: usize, current: &str) {
        if self.span.is_disabled() {
            return;
        }
        tracing::debug!(
            target: TARGET,
            parent: &self.span,
            done = done as u64,
            current,
            "progress"
        );
    }
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id};
    use tracing::{Event, Subscriber};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    use super::*;

    /// One span or event as the test layer saw it.
    struct Record {
        kind: &'static str,
        target: String,
        fields: Vec<String>,
    }

    /// Records every span and event.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<Record>>>);

    struct Names(Vec<String>);
    impl Visit for Names {
        fn record_debug(&mut self, field: &Field, _: &dyn fmt::Debug) {
            self.0.push(field.name().to_string());
        }
    }

    impl<S: Subscriber> Layer<S> for Seen {
        fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
            let mut names = Names(Vec::new());
            attrs.record(&mut names);
            self.0.lock().unwrap().push(Record {
                kind: "span",
                target: attrs.metadata().target().to_string(),
                fields: names.0,
            });
        }

        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut names = Names(Vec::new());
            event.record(&mut names);
            self.0.lock().unwrap().push(Record {
                kind: "event",
                target: event.metadata().target().to_string(),
                fields: names.0,
            });
        }
    }

    #[test]
    fn spans_and_events_carry_the_documented_fields() {
        let seen = Seen::default();
        let subscriber = tracing_subscriber::registry().with(seen.clone());
        tracing::subscriber::with_default(subscriber, || {
            let p = Progress::start("compiling 2 graphs", 2);
            p.update(1, "decode_b1");
            Progress::hidden().update(1, "not reported");
        });
        let seen = seen.0.lock().unwrap();
        let kinds: Vec<_> = seen.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, ["span", "event"]);
        assert!(seen.iter().all(|r| r.target == TARGET));
        assert_eq!(seen[0].fields, [field::TASK, field::TOTAL]);
        assert_eq!(seen[1].fields, ["message", field::DONE, field::CURRENT]);
    }
}
