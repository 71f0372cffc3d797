//! Where the library's `tracing` output goes: plain lines on stderr, and progress bars.
//!
//! The library reports through `tracing` and never prints; this module is the one place that
//! decides what reaches the terminal:
//!
//! - **Lines.** Events pass an env filter read from `DEEPINFER_LOG`, else `RUST_LOG`, else
//!   `info`, and are written to stderr as `deepinfer: <message>` (info), `warning: <message>`,
//!   `error: <message>`, or `debug: <target>: <message>` (debug and trace), other fields
//!   appended as `key=value`. No timestamps or colours: the lines read as the CLI's own (the
//!   engine's stats line, a corrupt NEFF cache entry), and a service manager adds its own
//!   timestamps.
//! - **Bars.** When stderr is a terminal, each open progress span
//!   ([`deepinfer::backend::neuron::progress`]) is drawn as an indicatif bar, whatever the filter
//!   says (the bar layer has its own). Lines are written above the bars (the bars are suspended
//!   while a line is written), so a warning during a compile does not tear the bar.
//!
//! Nothing here writes to stdout: that belongs to the commands' results.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, IsTerminal, Write};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use deepinfer::backend::neuron::progress::{self, field};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// The variables that set the filter, first match wins (`RUST_LOG` is the ecosystem's usual).
const FILTER_VARS: [&str; 2] = ["DEEPINFER_LOG", "RUST_LOG"];

/// The filter when neither variable is set.
const DEFAULT_FILTER: &str = "info";

/// Installs the process-wide subscriber. Call once, first thing in `main`.
pub(crate) fn init() {
    let (filter, bad) = filter_from_env();
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
    let lines = tracing_subscriber::fmt::layer()
        .event_format(Plain)
        .with_writer(AboveBars(multi.clone()))
        .with_filter(filter);
    let bars = io::stderr()
        .is_terminal()
        .then(|| Bars::new(multi).with_filter(filter_fn(|meta| meta.target() == progress::TARGET)));
    let subscriber = tracing_subscriber::registry().with(lines).with(bars);
    // Fails only if a subscriber is already installed, which then keeps working.
    let _ = tracing::subscriber::set_global_default(subscriber);
    if let Some((var, value, err)) = bad {
        tracing::warn!("ignoring {var}={value:?} ({err}); logging at `{DEFAULT_FILTER}`");
    }
}

/// The filter from the environment; an unparsable value falls back to the default and is
/// returned, to be reported once the subscriber is up.
#[allow(clippy::type_complexity)]
fn filter_from_env() -> (EnvFilter, Option<(&'static str, String, String)>) {
    for var in FILTER_VARS {
        let Some(value) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        return match EnvFilter::try_new(&value) {
            Ok(filter) => (filter, None),
            Err(e) => (
                EnvFilter::new(DEFAULT_FILTER),
                Some((var, value, e.to_string())),
            ),
        };
    }
    (EnvFilter::new(DEFAULT_FILTER), None)
}

/// The line format (see the module docs).
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        match *meta.level() {
            Level::ERROR => write!(writer, "error: ")?,
            Level::WARN => write!(writer, "warning: ")?,
            Level::INFO => write!(writer, "deepinfer: ")?,
            _ => write!(writer, "debug: {}: ", meta.target())?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Writes each formatted line to stderr in one piece, with the progress bars suspended.
#[derive(Clone)]
struct AboveBars(MultiProgress);

impl<'a> MakeWriter<'a> for AboveBars {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line {
            bars: self.0.clone(),
            buf: Vec::new(),
        }
    }
}

/// One event's text, written out when dropped.
struct Line {
    bars: MultiProgress,
    buf: Vec<u8>,
}

impl Write for Line {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            // Nowhere to report a failed write to stderr.
            self.bars.suspend(|| {
                let _ = io::stderr().lock().write_all(&self.buf);
            });
        }
    }
}

/// Draws one bar per open progress span.
struct Bars {
    multi: MultiProgress,
    open: Mutex<HashMap<Id, ProgressBar>>,
}

impl Bars {
    fn new(multi: MultiProgress) -> Self {
        Bars {
            multi,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn bar(&self, id: &Id) -> Option<ProgressBar> {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(id).cloned()
    }
}

/// One line: spinner, the task, bar, done/total, elapsed, what is in flight.
const BAR_TEMPLATE: &str = "{spinner} {prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {wide_msg}";

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(BAR_TEMPLATE)
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

impl<S: Subscriber> Layer<S> for Bars {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().target() != progress::TARGET {
            return;
        }
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let Some(total) = fields.total else { return };
        let bar = self.multi.add(ProgressBar::new(total));
        bar.set_style(bar_style());
        bar.set_prefix(fields.task.unwrap_or_default());
        bar.enable_steady_tick(Duration::from_millis(200));
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.insert(id.clone(), bar);
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let Some(bar) = event.parent().and_then(|id| self.bar(id)) else {
            return;
        };
        let mut fields = Fields::default();
        event.record(&mut fields);
        if let Some(done) = fields.done {
            bar.set_position(done);
        }
        if let Some(current) = fields.current {
            bar.set_message(current);
        }
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        let bar = {
            let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
            open.remove(&id)
        };
        if let Some(bar) = bar {
            bar.finish_and_clear();
            self.multi.remove(&bar);
        }
    }
}

/// The progress fields of one span or event.
#[derive(Default)]
struct Fields {
    task: Option<String>,
    total: Option<u64>,
    done: Option<u64>,
    current: Option<String>,
}

impl Visit for Fields {
    fn record_u64(&mut self, f: &Field, value: u64) {
        match f.name() {
            field::TOTAL => self.total = Some(value),
            field::DONE => self.done = Some(value),
            _ => {}
        }
    }

    fn record_i64(&mut self, f: &Field, value: i64) {
        if let Ok(v) = u64::try_from(value) {
            self.record_u64(f, v);
        }
    }

    fn record_str(&mut self, f: &Field, value: &str) {
        match f.name() {
            field::TASK => self.task = Some(value.to_string()),
            field::CURRENT => self.current = Some(value.to_string()),
            _ => {}
        }
    }

    fn record_debug(&mut self, f: &Field, value: &dyn fmt::Debug) {
        // `task = %x` arrives as Display-through-Debug.
        if f.name() == field::TASK || f.name() == field::CURRENT {
            self.record_str(f, &format!("{value:?}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use deepinfer::backend::neuron::progress::Progress;

    use super::*;

    /// Forwards to a shared [`Bars`] so the test can look at its open bars.
    struct Shared(Arc<Bars>);

    impl<S: Subscriber> Layer<S> for Shared {
        fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
            self.0.on_new_span(attrs, id, ctx)
        }
        fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
            self.0.on_event(event, ctx)
        }
        fn on_close(&self, id: Id, ctx: Context<'_, S>) {
            self.0.on_close(id, ctx)
        }
    }

    fn open_bars(bars: &Bars) -> Vec<(String, u64, Option<u64>, String)> {
        let open = bars.open.lock().unwrap();
        open.values()
            .map(|b| (b.prefix(), b.position(), b.length(), b.message()))
            .collect()
    }

    #[test]
    fn a_progress_span_is_one_bar_until_it_ends() {
        let bars = Arc::new(Bars::new(MultiProgress::with_draw_target(
            ProgressDrawTarget::hidden(),
        )));
        let subscriber = tracing_subscriber::registry().with(Shared(bars.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let p = Progress::start("compiling 3 graphs", 3);
            p.update(1, "decode_b1, decode_b2");
            assert_eq!(
                open_bars(&bars),
                [(
                    "compiling 3 graphs".to_string(),
                    1,
                    Some(3),
                    "decode_b1, decode_b2".to_string()
                )]
            );
            p.update(3, "");
            assert_eq!(open_bars(&bars)[0].1, 3);
            drop(p);
            assert!(open_bars(&bars).is_empty());
            // Spans of other kinds draw nothing.
            let _other = tracing::info_span!("request", total = 5u64);
            assert!(open_bars(&bars).is_empty());
        });
    }

    #[test]
    fn the_bar_template_parses() {
        ProgressStyle::with_template(BAR_TEMPLATE).unwrap();
    }
}
