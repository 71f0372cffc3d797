//! A failed call: the `NRT_STATUS` it returns and the message `last_error` records.
//!
//! Every safe body returns [`Res`]; the `extern "C"` shells in `ffi` turn it into a status.
//! A status plus a message rather than a `thiserror` enum because the status *is* the
//! interface (the crate docs promise one per misuse) and the message is for a human reading
//! the counters; a variant per message would only restate each call site.

use std::fmt;

use neuron_sys::sys::{self, NRT_STATUS};

use crate::handle::{Kind, Lookup};

/// A failed call: the status to return and a message for `last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fail {
    pub(crate) status: NRT_STATUS,
    pub(crate) msg: String,
}

impl Fail {
    /// A failure with any status.
    pub(crate) fn new(status: NRT_STATUS, msg: impl Into<String>) -> Fail {
        Fail {
            status,
            msg: msg.into(),
        }
    }

    /// `NRT_INVALID`: a bad argument (range, size, name, null out-pointer).
    pub(crate) fn invalid(msg: impl Into<String>) -> Fail {
        Fail::new(sys::NRT_INVALID, msg)
    }

    /// A handle that did not resolve: `NRT_INVALID_HANDLE`, naming what was wrong.
    pub(crate) fn handle(what: &str, kind: Kind, why: Lookup) -> Fail {
        let msg = match why {
            Lookup::Null => format!("{what} is a null {}", kind.c_name()),
            Lookup::Stale => format!(
                "{what} is a freed {} (use after free, double free, or released by nrt_close)",
                kind.c_name()
            ),
            Lookup::Foreign => format!("{what} is not a live {}", kind.c_name()),
        };
        Fail::new(sys::NRT_INVALID_HANDLE, msg)
    }
}

impl fmt::Display for Fail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            sys::status_name(self.status),
            self.status,
            self.msg
        )
    }
}

/// A call's result.
pub(crate) type Res<T> = Result<T, Fail>;
