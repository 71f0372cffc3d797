//! `NEURON_RT_LIB` pointing at a file that does not exist. This is the only test in its
//! binary because it sets an environment variable (not thread-safe with other tests).

use neuron_sys::{Error, Library};

#[test]
fn neuron_rt_lib_to_a_missing_file_is_listed_first() {
    let bogus = "/nonexistent/deepinfer-env-test/libnrt.so.1";
    std::env::set_var("NEURON_RT_LIB", bogus);
    match Library::load() {
        Err(Error::LibraryNotFound { tried }) => {
            let places: Vec<&str> = tried.iter().map(|t| t.place.as_str()).collect();
            assert_eq!(places.len(), 3, "{places:?}");
            assert!(places[0].starts_with(bogus), "{places:?}");
            assert!(places[0].contains("NEURON_RT_LIB"), "{places:?}");
            assert!(places[1].starts_with("libnrt.so.1"), "{places:?}");
            assert!(
                places[2].starts_with("/opt/aws/neuron/lib/libnrt.so.1"),
                "{places:?}"
            );
            assert!(tried[0].reason.contains("No such file"), "{:?}", tried[0]);
        }
        // A machine with the Neuron runtime installed finds it after the bogus path.
        Ok(lib) => assert_ne!(lib.name(), bogus),
        Err(other) => panic!("unexpected error: {other}"),
    }
}
